"""Model loading: GGUF file -> config -> Transformer."""
from __future__ import annotations

from ..gguf_file import GGUFFile
from .config import SUPPORTED_ARCHS, ModelConfig, config_from_gguf
from .transformer import Transformer

__all__ = ["load_model", "Transformer", "ModelConfig", "SUPPORTED_ARCHS", "config_from_gguf"]


def load_model(path_or_file) -> Transformer:
    gf = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    return Transformer(gf)
