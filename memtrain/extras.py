"""The optional parts of memtrain, installed as pip extras (pyproject.toml,
`[project.optional-dependencies]`), and the sentence a missing one is reported with.

    pip install 'memtrain[lm-eval]'     evaluation/lm_eval_model.py (lm-evaluation-harness)
    pip install 'memtrain[gguf]'        `model.hf.gguf_file`, `--tokenizer-gguf-file`
    pip install 'memtrain[lora]'        `model.hf.finetune: lora` (peft's adapters)
    pip install 'memtrain[datasets]'    `memtrain prepare --corpus datasets`

A leaf like memtrain/command_line.py (standard library only), so that model/ and
data_pipeline/ can ask it without depending on anything above them. Callers raise their own
error with the sentence: a config field's ConfigError, or an ImportError.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "missing_extra"]

# extra -> (the module it provides, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "lm-eval": ("lm_eval", "an lm-evaluation-harness model (evaluation/lm_eval_model.py)"),
    "gguf": ("gguf", "reading a GGUF file"),
    "lora": ("peft", "LoRA fine-tuning (model.hf.finetune: lora)"),
    "datasets": ("datasets", "--corpus datasets (a folder datasets.save_to_disk wrote)"),
}


def missing_extra(extra: str) -> str | None:
    """None when the extra's module can be imported; else what to install, as a sentence."""
    module, purpose = EXTRAS[extra]
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{purpose} needs the optional package {module!r}: pip install 'memtrain[{extra}]'"

