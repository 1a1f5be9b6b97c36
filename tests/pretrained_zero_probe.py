"""Run on 2 ranks (tests/launch_ranks.py) by test_pretrained_zero.py in place of
`python -m train`: the training run itself, with the trainer's call of deepspeed.initialize
wrapped to record what each rank holds of the model just before it (right after
train/pretrained.py built it) and just after it. Nothing else changes: the run trains,
checkpoints and exports as always.

Prints one JSON line from rank 0, with every rank's numbers (elements of the parameters:
a ZeRO-3 parameter's partition `ds_tensor` plus any whole tensor, train.pretrained.
local_share):
  base_before  of the pretrained base, before deepspeed.initialize (base_full: all of it)
  model_after  of the whole model, after it (model_full: all of it)
  memory_after of the initial memory, made outside zero.Init, after it (memory_full)
  dtypes       the dtypes this rank holds the parameters in, after it
"""

import json
import sys

import torch.distributed as dist

import train.trainer as trainer
from train.cli import main_train
from train.pretrained import local_share

_initialize = trainer.initialize


def recording_initialize(model, cfg, ds_config):
    base_before, base_full = local_share(model.base)
    engine, schedule = _initialize(model, cfg, ds_config)
    model_after, model_full = local_share(engine.module)
    memory_after, memory_full = local_share(engine.module.memory_init)
    dtypes = sorted({str(getattr(p, "ds_tensor", p).dtype) for p in engine.module.parameters()})
    mine = {"base_before": base_before, "model_after": model_after,
            "memory_after": memory_after, "dtypes": dtypes}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"case": "initialize", "base_full": base_full,
                          "model_full": model_full, "memory_full": memory_full,
                          **{key: [r[key] for r in every] for key in mine}}), flush=True)
    return engine, schedule


trainer.initialize = recording_initialize
if __name__ == "__main__":
    sys.exit(main_train(sys.argv[1:]))
