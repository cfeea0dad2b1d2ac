"""The decoders `hf-deep-nmt translate --backend` chooses from, by name: one is made per run, and the translate loop
sees only its `Decoder` interface."""

from __future__ import annotations

from hf_deep_nmt.serving.onnx import OnnxDecoder
from hf_deep_nmt.serving.torch_decoder import TorchDecoder

DECODERS = {"torch": TorchDecoder, "onnxruntime": OnnxDecoder}
