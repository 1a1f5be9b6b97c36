"""model/pretrained/: RMT memory tokens around a pretrained Hugging Face causal LM.

    loading.py     read the checkpoint's shape into ModelConfig; load the weights; freeze or
                   attach LoRA adapters (peft)
    positions.py   where the memory tokens sit: the position ids and attention pattern
    wrapper.py     PretrainedMemoryLM: the same (tokens, memory) -> (loss, memory) model as
                   the native stack, so the engine never asks which one it runs

Knows nothing of DeepSpeed, MLflow or SLURM: a sharded ZeRO-3 load is train/'s business
(train/pretrained.py), which hands this package the already-built base model.
"""

from .wrapper import PretrainedMemoryLM

__all__ = ["PretrainedMemoryLM"]
