"""model/: the memory mechanisms (XL, LaMemo, RMT, ARMT) on one relative-position decoder
backbone, or around a pretrained one (model/pretrained/).

Knows nothing of DeepSpeed, MLflow, SLURM or the data pipeline.
"""

from .associative import AssociativeMemory
from .config import ARMTOptions, ConfigError, LaMemoOptions, ModelConfig, RMTOptions
from .generate import filter_logits, generate, stream_generate
from .io import load_model, save_model
from .lm import LMOutput, MemoryLM, bits_per_token, build_model
from .memory import LaMemoMemory, MemoryState, RMTMemory, XLMemory

__all__ = [
    "ARMTOptions", "AssociativeMemory", "ConfigError", "LaMemoOptions", "ModelConfig",
    "RMTOptions",
    "filter_logits", "generate", "stream_generate", "load_model", "save_model",
    "LMOutput", "MemoryLM", "bits_per_token", "build_model",
    "LaMemoMemory", "MemoryState", "RMTMemory", "XLMemory",
]
