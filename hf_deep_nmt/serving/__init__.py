"""The serving journey: from a trained model folder (or Hub id) to translations, and to the formats other engines run.

`options` holds the decoding options every backend takes, `translate` the translate loop and its text files, `onnx`
the ONNX Runtime export and decoder, `ctranslate2` the CTranslate2 export."""
