"""model/: the memory mechanisms (Transformer-XL, LaMemo, RMT, ARMT, Titans; one module each in
model/mechanisms/, one registry) on one relative-position decoder backbone, or around a
pretrained one (model/pretrained/).

Knows nothing of DeepSpeed, MLflow or SLURM; of the data pipeline it uses only the atomic
file writer (io.py) and a pretrained tokenizer's fingerprint (backbones/pretrained.py).
"""

from .backbones import backbone_of, build_model, resolve_shape
from .config import ConfigError, ModelConfig
from .generate import filter_logits, generate, stream_generate
from .io import load_model, save_model
from .lm import LMOutput, MemoryLM, bits_per_token
from .mechanisms.armt.associative import AssociativeMemory
from .mechanisms.armt.options import ARMTOptions
from .mechanisms.lamemo.options import LaMemoOptions
from .mechanisms.rmt.options import RMTOptions
from .memory import LaMemoMemory, MemoryState, RMTMemory, XLMemory

__all__ = [
    "ARMTOptions", "AssociativeMemory", "ConfigError", "LaMemoOptions", "ModelConfig",
    "RMTOptions",
    "filter_logits", "generate", "stream_generate", "load_model", "save_model",
    "LMOutput", "MemoryLM", "bits_per_token", "backbone_of", "build_model", "resolve_shape",
    "LaMemoMemory", "MemoryState", "RMTMemory", "XLMemory",
]
