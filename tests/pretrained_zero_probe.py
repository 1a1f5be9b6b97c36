"""Run under torchrun by test_pretrained_zero.py: what each rank holds of a pretrained
model at ZeRO-3, right after train/pretrained.py loaded it and after deepspeed.initialize.

argv: a run config (backbone: hf, deepspeed.zero_stage 3) and overrides. Prints one JSON line from
rank 0, with every rank's numbers:
  base_local  elements of the base this rank holds after loading (its partitions plus any
              whole tensor), before deepspeed.initialize; base_full: the base's elements
  unpartitioned_after  names of the engine's parameters that are not ZeRO-3 partitioned
              after deepspeed.initialize (a ZeRO parameter keeps an empty `data`)
  memory_local  elements of the initial memory (made outside zero.Init) this rank holds
              after deepspeed.initialize; memory_full: its elements
  dtypes      the dtypes of this rank's partitions after deepspeed.initialize
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from train.config import load_config
from train.distributed import init_process_group, resolve_env
from train.engine import build_ds_config, initialize
from train.pretrained import build_for_engine, local_share

env = resolve_env()
init_process_group(env)
cfg = load_config(sys.argv[1], sys.argv[2:])
ds_config = build_ds_config(cfg, env.world_size)
torch.manual_seed(cfg.seed)
model = build_for_engine(cfg.model, ds_config, is_main=False)
base_local, base_full = local_share(model.base)
engine, _ = initialize(model, cfg, ds_config)
unpartitioned = [n for n, p in engine.module.named_parameters()
                 if not hasattr(p, "ds_id") or p.numel() != 0]
memory_local, memory_full = local_share(engine.module.memory_init)
mine = {"base_local": base_local, "memory_local": memory_local,
        "unpartitioned_after": unpartitioned,
        "dtypes": sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()
                          if hasattr(p, "ds_tensor")})}
every = [None] * env.world_size
dist.all_gather_object(every, mine)
if env.rank == 0:
    print(json.dumps({"case": "zero3", "base_full": base_full, "memory_full": memory_full,
                      **{key: [r[key] for r in every] for key in mine}}), flush=True)
dist.barrier()
dist.destroy_process_group()
# As tests/engine_probe.py explains: gloo's worker threads can abort a rank in the
# interpreter's teardown after the results are out; leave without it.
sys.stdout.flush()
os._exit(0)
