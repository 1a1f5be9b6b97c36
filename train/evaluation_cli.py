"""`memtrain eval`: score a run's checkpoint under any evaluation protocol, without DeepSpeed.

The fp32 weights are consolidated from the checkpoint (any ZeRO stage) into a plain model;
launched on several ranks (torchrun / srun), each rank reads its rows and the sums are
all-reduced. The report goes to `<run_dir>/eval/` and into the run's MLflow run.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from .checkpoint import CheckpointInfo, _read, find_latest
from .config import RunConfig
from .distributed import device_for, resolve_env
from .evaluate import evaluate, headline, protocol_for
from .export import load_weights


def pick_checkpoint(cfg: RunConfig, name: str | None) -> CheckpointInfo | None:
    root = cfg.resolved_run_dir / "checkpoints"
    if name is None:
        return find_latest(root)
    info = _read(root / name)
    if info is None:
        raise FileNotFoundError(f"{root / name} is not a complete checkpoint")
    return info


def run_eval(cfg: RunConfig, checkpoint: str | None, track: bool = True) -> dict | None:
    from data_pipeline.shards import load_manifest

    env = resolve_env()
    if env.world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    device = device_for(env.local_rank)
    info = pick_checkpoint(cfg, checkpoint)
    if info is None:
        print(f"memtrain eval: no complete checkpoint in {cfg.resolved_run_dir}",
              file=sys.stderr)
        return None
    model = load_weights(info, cfg.model).to(device)
    manifest = load_manifest(cfg.data.path)
    proto = protocol_for(cfg)
    report = evaluate(model, model, manifest, proto, env.rank, env.world_size, device,
                      url_template=cfg.data.url_template, seed=cfg.data.seed)
    report.update(checkpoint=info.path.name, step=info.step)
    if env.is_main:
        print(headline(report), flush=True)
        out_dir = cfg.resolved_run_dir / "eval"
        out_dir.mkdir(exist_ok=True)
        name = f"eval_{info.tag}_{proto.split}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        (out_dir / name).write_text(json.dumps(report, indent=1))
        if track and cfg.tracking.enabled:
            from .tracking import Tracker
            tracker = Tracker(cfg.resolved_run_dir, experiment=cfg.tracking.experiment,
                              run_name=cfg.name, tracking_uri=cfg.tracking.uri or None)
            tag = f"eval_{proto.split}_m{proto.mem_len}_l{proto.tgt_len}"
            tracker.log_metrics({f"{tag}_loss": report["loss"]}, info.step)
            tracker.log_artifact(out_dir / name, "eval")
            # Leave the training run's status as training left it (e.g. KILLED when it was
            # interrupted), not FINISHED because an evaluation finished.
            try:
                run_state = json.loads((cfg.resolved_run_dir / "status.json").read_text())
            except (OSError, ValueError):
                run_state = {}
            tracker.close({"finished": "FINISHED", "interrupted": "KILLED"}.get(
                run_state.get("state"), "FAILED" if run_state else "FINISHED"))
    if env.world_size > 1:
        torch.distributed.destroy_process_group()
    return report
