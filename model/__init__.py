"""model/: the memory mechanisms (Transformer-XL, LaMemo, RMT, ARMT; one module each in
model/mechanisms/, one registry) on one relative-position decoder backbone, or around a
pretrained one (model/pretrained/).

Knows nothing of DeepSpeed, MLflow, SLURM or the data pipeline.
"""

from .associative import AssociativeMemory
from .config import ConfigError, ModelConfig
from .generate import filter_logits, generate, stream_generate
from .io import load_model, save_model
from .lm import LMOutput, MemoryLM, bits_per_token, build_model
from .mechanisms.armt import ARMTOptions
from .mechanisms.lamemo import LaMemoOptions
from .mechanisms.rmt import RMTOptions
from .memory import LaMemoMemory, MemoryState, RMTMemory, XLMemory

__all__ = [
    "ARMTOptions", "AssociativeMemory", "ConfigError", "LaMemoOptions", "ModelConfig",
    "RMTOptions",
    "filter_logits", "generate", "stream_generate", "load_model", "save_model",
    "LMOutput", "MemoryLM", "bits_per_token", "build_model",
    "LaMemoMemory", "MemoryState", "RMTMemory", "XLMemory",
]
