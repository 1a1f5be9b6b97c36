"""Run on N ranks by the tests (train_helpers.run_optimizer_probe): resume a run's latest
checkpoint through train.trainer (the real restore: same world size, or re-sharded through
DeepSpeed's universal checkpoint) and, instead of training on, save the Adam state the engine
holds right after the resume, gathered in full fp32 on rank 0:

    {"step": sorted Adam step values, "exp_avg": {parameter: flat tensor}, "exp_avg_sq": ...}

    python tests/launch_ranks.py N PORT tests/optimizer_probe.py <config.yaml> <out.pt>
        [--train-on override ...]
    python tests/launch_ranks.py N PORT tests/optimizer_probe.py <config.yaml> <out.pt>
        --after-training

With --train-on the run then trains on as `python -m train` would, with the overrides
(max_steps=N): one launch both reads the restored state and continues the run (the Adam
state is only read, so the steps after it are those of a plain resume).

With --after-training the launch is `python -m train` (a new run, or a resume as the trainer
decides), and the Adam state is saved once the run has finished: the state its last
checkpoint holds, as the engine that wrote it had it.
"""

import sys

import torch
from deepspeed.utils import safe_get_full_optimizer_state

from train import trainer
from train.config import load_config
from train.loop import TrainingLoop

MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_state(engine) -> dict:
    """Collective under ZeRO-3: every rank gathers every parameter, in the same order."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps torch's
    # ZeRO-1/2 map each parameter onto its slice of the flat optimizer state only at the
    # first step; before one (right after a resume) the gather needs the mapping made here.
    # After training the mapping can point at a state dict Adam has since replaced (the
    # gather then finds no exp_avg): it is made afresh either way.
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        link()
    out = {key: {} for key in MOMENTS}
    for name, param in engine.module.named_parameters():
        for key in MOMENTS:
            full = safe_get_full_optimizer_state(param, key)
            if full is None:  # ZeRO-0: torch's Adam keeps its state per parameter
                full = inner.state[param][key]
            out[key][name] = full.detach().float().cpu().reshape(-1).clone()
    out["step"] = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return out


AFTER = "--after-training" in sys.argv
TRAIN_ON = "--train-on" in sys.argv
OVERRIDES = sys.argv[sys.argv.index("--train-on") + 1:] if TRAIN_ON else []


class Probe(TrainingLoop):
    def save_adam_state(self) -> None:
        state = adam_state(self.engine)
        if self.env.is_main:
            torch.save(state, sys.argv[2])

    def run(self) -> str:
        if AFTER:
            result = super().run()
            self.save_adam_state()
            return result
        self.save_adam_state()
        return super().run() if TRAIN_ON else "finished"


trainer.TrainingLoop = Probe
sys.exit(trainer.main_entry(load_config(sys.argv[1], OVERRIDES),
                            resume=True if AFTER else "require"))
