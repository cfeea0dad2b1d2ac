"""The serving journey: from a trained model folder (or Hub id) to translations, and to the formats other engines run.

`options` holds the decoding options every backend takes; `translate` the one translate loop, which hands batches to a
`decoder` (the seam: `torch_decoder` runs the model's `generate()`, `onnx` the exported graphs on ONNX Runtime,
`ctranslate2_decoder` the CTranslate2 export, `backends` names them for the command line); beside the loop,
`text_files` (reading, output-path safety, streamed writing), `threads` (the thread policy) and `compiled` (compiled
decoding); the exporters are `onnx_export` and `ctranslate2`, and what their decoders read of an export without
torch is in `onnx_layout` and `ctranslate2_layout`."""
