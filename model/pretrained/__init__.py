"""model/pretrained/: a memory mechanism (RMT, ARMT, or any registered one that states how,
model/mechanisms/) around a pretrained Hugging Face causal LM.

    architectures.py  the planner's layer layouts, the one table of model types left
    traits.py      what an architecture is, read from its config: positions, logits'
                   post-processing, sliding windows, mixture of experts
    probe.py       the same checked once at load against the model's own forward
    router.py      a mixture-of-experts base's load-balancing loss, as its forward adds it
    checkpoint_config.py  the shape read from the checkpoint's config (a step of its own,
                   after the ModelConfig is built); the segment lengths its positions allow
    incremental.py generation: the open segment read through the base model's KV cache
    loading.py     load the weights and tokenizer; freeze, or attach LoRA adapters (peft)
    positions.py   where the memory tokens sit: the position ids and attention pattern
    wrapper.py     PretrainedMemoryLM: the same (tokens, memory) -> (loss, memory) model as
                   the native stack, so the engine never asks which one it runs; the
                   mechanism's own module runs each segment around the base decoder

Knows nothing of DeepSpeed, MLflow or SLURM: a sharded ZeRO-3 load is train/'s business
(train/pretrained.py), which hands this package the already-built base model.

Nothing is imported here: the backbone interface (model/backbones/pretrained.py) imports
checkpoint_config.py without transformers, which only building a model loads.
"""
