"""model/: the memory mechanisms (XL, LaMemo, RMT, ARMT) on one relative-position decoder
backbone, or around a pretrained one (model/pretrained/).

Knows nothing of DeepSpeed, MLflow or SLURM; of the data pipeline it uses only the atomic
file writer (io.py) and a pretrained tokenizer's fingerprint (backbones/pretrained.py).
"""

from .associative import AssociativeMemory
from .backbones import backbone_of, build_model, resolve_shape
from .config import ARMTOptions, ConfigError, LaMemoOptions, ModelConfig, RMTOptions
from .generate import filter_logits, generate, stream_generate
from .io import load_model, save_model
from .lm import LMOutput, MemoryLM, bits_per_token
from .memory import LaMemoMemory, MemoryState, RMTMemory, XLMemory

__all__ = [
    "ARMTOptions", "AssociativeMemory", "ConfigError", "LaMemoOptions", "ModelConfig",
    "RMTOptions",
    "filter_logits", "generate", "stream_generate", "load_model", "save_model",
    "LMOutput", "MemoryLM", "bits_per_token", "backbone_of", "build_model", "resolve_shape",
    "LaMemoMemory", "MemoryState", "RMTMemory", "XLMemory",
]
