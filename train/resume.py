"""Resuming a run from a checkpoint, on the same or on another number of ranks."""

from __future__ import annotations

import warnings

import torch

from model import MemoryState

from . import checkpoint as ckpt
from .bptt import TrainState
from .process_group import barrier


def restore(info, engine, state: TrainState, stream, env, device) -> None:
    """Load checkpoint `info` into the engine, the train state and the stream. The same
    world size resumes exactly (RNG included); another one re-shards weights and optimizer
    through DeepSpeed's universal checkpoint and regroups the per-rank rows."""
    same_world = info.world_size == env.world_size
    tag = info.tag if same_world or info.zero_stage == 0 else None
    if tag is None:
        if env.is_main:
            ckpt.to_universal(info)
        barrier()
        tag = f"{info.tag}_universal"
    path, _ = engine.load_checkpoint(str(info.path.parent), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {info.path.parent / tag}")
    if tag.endswith("_universal"):
        _unshare_adam_steps(engine)
    payload = ckpt.load_rank_payload(info, env.rank if same_world else 0)
    state.step, state.tokens_seen = payload["step"], payload["tokens_seen"]
    if same_world:
        stream.load_state_dict(payload["stream"])
        mem = payload["memory"]
        state.memory = None if mem is None else MemoryState.from_state_dict(mem).to(device)
        state.plan.load_state_dict(payload["history"], device)
        ckpt.set_rng_state(payload["rng"])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # our own warning below says it all
            stream.load_state_dict(payload["stream"])
        if info.meta.get("global_batch") == len(stream.rows) * env.world_size:
            _regroup_rows(info, state, stream.rows, device)
            what = "memory and BPTT history regrouped by rows"
        else:
            what = "global batch changed: memory reset"
        msg = (f"resuming a {info.world_size}-rank checkpoint on {env.world_size} ranks: model "
               f"and optimizer re-sharded, streams continue at step {state.step}, {what}; "
               "dropout RNG streams restart per rank")
        if env.is_main:
            warnings.warn(msg, stacklevel=2)
            print(f"WARNING: {msg}", flush=True)


def _unshare_adam_steps(engine) -> None:
    """DeepSpeed 0.19's ZeRO-3 universal loader gives every optimizer sub-group one shared
    Adam `step` tensor; torch's Adam increments `step` in place once per group, so with our
    two groups (decay / no decay) a resumed run counted two Adam steps per step and its
    losses drifted from the uninterrupted run's (tests/test_multinode_rehearsal.py). Give
    each group its own copy."""
    inner = getattr(engine.optimizer, "optimizer", None)  # ZeRO-0 has no wrapped optimizer
    for group_state in getattr(inner, "state", {}).values():
        if isinstance(group_state.get("step"), torch.Tensor):
            group_state["step"] = group_state["step"].clone()


def _regroup_rows(info, state: TrainState, rows: range, device) -> None:
    """Another world size, the same global batch: rows are global (rank r of W holds rows
    [r*B/W, (r+1)*B/W)), so join every old rank's memory and sliding-BPTT history in rank
    order and keep this rank's rows. The run then continues as if never stopped, except
    for the per-rank dropout RNG."""
    payloads = [ckpt.load_rank_payload(info, r) for r in range(info.world_size)]
    index = torch.tensor(list(rows))

    def joined(states: list) -> MemoryState | None:
        if any(s is None for s in states):
            return None
        whole = MemoryState.concat_rows([MemoryState.from_state_dict(s) for s in states])
        return whole.select_rows(index).to(device)

    state.memory = joined([p["memory"] for p in payloads])
    histories = [p["history"] for p in payloads]
    items = []
    for per_rank in zip(*(h["items"] for h in histories), strict=True):
        first = per_rank[0]
        masks = [it["loss_mask"] for it in per_rank]
        before = joined([it["state_before"] for it in per_rank])
        items.append({
            "tokens": torch.cat([it["tokens"] for it in per_rank])[index],
            "reset": torch.cat([it["reset"] for it in per_rank])[index],
            "loss_mask": None if masks[0] is None else torch.cat(masks)[index],
            "epoch": first["epoch"], "step": first["step"],
            "state_before": None if before is None else before.to("cpu").state_dict()})
    state.plan.load_state_dict({"depth": histories[0]["depth"], "items": items}, device)
