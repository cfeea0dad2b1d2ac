"""The decoders `hf-deep-nmt translate --backend` chooses from, by name: one is made per run, and the translate loop
sees only its `Decoder` interface."""

from __future__ import annotations

from hf_deep_nmt.serving.ctranslate2_decoder import (
    CTranslate2Decoder,
)  # imports the ctranslate2 package only when made
from hf_deep_nmt.serving.onnx import OnnxDecoder
from hf_deep_nmt.serving.torch_decoder import TorchDecoder

DECODERS = {"torch": TorchDecoder, "onnxruntime": OnnxDecoder}
DECODERS["ctranslate2"] = CTranslate2Decoder
