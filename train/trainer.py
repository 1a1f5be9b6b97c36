"""The training run: streams -> BPTT windows -> DeepSpeed engine, with checkpoints, signals,
validation and tracking. One function, `train(cfg)`, run by every rank.

Per optimizer step, each of the `grad_accum` micro-steps runs one BPTT window (bptt.py) and
makes exactly one backward. The loss sums and a non-finite flag stay on the device; after the
backward of the step's last micro-step (of every micro-step under fp16), one all-reduce
gathers them with a stop flag (SIGTERM / SIGUSR1) and is read once: the step's only host
sync (issue 14; tests/test_sync_free.py counts them), so every rank takes the same decision at
the same step boundary: skip under fp16 loss scaling, stop cleanly otherwise, or checkpoint
and leave.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from data_pipeline.shards import ShardError, load_manifest
from data_pipeline.streams import EpisodeStream, LayoutError, TokenStream, rows_of_rank
from data_pipeline.synthetic import write_repeat_corpus
from model import ConfigError, bits_per_token, build_model
from model.compiled import compiled_graphs

from . import checkpoint as ckpt
from .bptt import TrainState, WindowPlan, run_window
from .config import RunConfig, dump_yaml
from .curriculum import SegmentCurriculum
from .distributed import (
    barrier,
    device_for,
    init_process_group,
    rank_seed,
    resolve_env,
)
from .engine import build_ds_config, initialize, zero_stage
from .evaluate import evaluate, headline, protocol_for
from .export import export_checkpoint
from .progress import Progress, peak_memory_mb
from .resume import restore
from .run_dir import RUNNING, RunDir, atomic_write_json, atomic_write_text
from .tracking import Tracker


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/Inf outside fp16 loss scaling; nothing was saved after it."""


class StopSignal:
    """SIGTERM (preemption, scancel) and SIGUSR1 (SLURM's warning before the time limit)
    only set a flag; the loop acts on it at the next step boundary, on every rank at once."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = signum


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_run(cfg: RunConfig, world_size: int, device: torch.device) -> None:
    """Checks that need the world or the device, still before any engine exists."""
    rows_of_rank(cfg.data.global_batch, 0, world_size)  # LayoutError with the numbers
    try:
        rows_of_rank(cfg.eval.batch or cfg.data.global_batch, 0, world_size)
    except LayoutError as err:
        raise ConfigError("eval.batch", str(err)) from None
    if cfg.deepspeed.precision != "fp32" and device.type != "cuda":
        raise ConfigError("deepspeed.precision", f"{cfg.deepspeed.precision} is for GPUs "
                          "(bf16 on A100, fp16 with loss scaling on V100); use fp32 on CPU")


def open_data(cfg: RunConfig, rank: int):
    """The manifest (generated first by rank 0 for `data.generate`), checked against the
    model, before any engine exists."""
    path = Path(cfg.data.path)
    if cfg.data.generate and rank == 0 and not (path / "manifest.json").exists():
        write_repeat_corpus(path, n_symbols=cfg.model.vocab_size, seed=cfg.data.seed)
    barrier()
    manifest = load_manifest(cfg.data.path)
    if manifest.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the "
                          f"data's vocabulary ({manifest.vocab_size} ids in {cfg.data.path})")
    if manifest.kind == "episodes":
        seg = (manifest.chunk_tokens - 1) // int(manifest.extra["n_segments"])
        if seg != cfg.model.tgt_len:
            raise ConfigError("model.tgt_len", f"{cfg.model.tgt_len} differs from the task's "
                              f"segment length {seg} ({cfg.data.path})")
    WindowPlan(cfg.bptt, manifest.kind == "episodes")  # refuses what cannot be planned
    return manifest


def _stream(cfg: RunConfig, manifest, rank: int, world: int):
    d = cfg.data
    if manifest.kind == "episodes":
        return EpisodeStream(manifest, d.train_split, d.global_batch, rank, world, seed=d.seed,
                             url_template=d.url_template or None)
    return TokenStream(manifest, d.train_split, d.global_batch, cfg.model.tgt_len, rank, world,
                       prefetch=d.prefetch, url_template=d.url_template or None)


def train(cfg: RunConfig, resume: bool | str = True) -> int:
    """Run (or continue) the training run `cfg` on this rank. resume: True = continue the
    latest checkpoint if any, False = refuse a run directory with checkpoints, "require" =
    fail unless there is one."""
    env = resolve_env()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    init_process_group(env, timeout_minutes=cfg.distributed.timeout_minutes)
    device = device_for(env.local_rank)
    check_run(cfg, env.world_size, device)
    run = RunDir(cfg.resolved_run_dir)
    run_dir, ckpt_root = run.path, run.checkpoints
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    manifest = open_data(cfg, env.rank)
    stream = _stream(cfg, manifest, env.rank, env.world_size)
    curriculum = SegmentCurriculum(cfg.curriculum, stream, manifest, cfg.data.path)
    info = ckpt.agreed_latest(ckpt_root) if resume else None   # rank 0's choice, on all
    if resume == "require" and info is None:
        raise ConfigError("--resume", f"no complete checkpoint in {ckpt_root}")
    if not resume and ckpt.agreed_latest(ckpt_root) is not None:
        raise ConfigError("run_dir", f"{run_dir} already holds checkpoints; resume it, or "
                          "choose another name / run_dir for a fresh run")
    ds_config = build_ds_config(cfg, env.world_size, load_universal=bool(
        info and info.world_size != env.world_size and info.zero_stage > 0))
    if info is not None and info.zero_stage != zero_stage(ds_config):
        raise ConfigError("deepspeed.zero_stage", f"the checkpoint {info.path} was saved at "
                          f"ZeRO-{info.zero_stage}; resume at the same stage (changing it "
                          "through DeepSpeed's universal checkpoint fails)")
    if env.is_main:
        atomic_write_text(run.config, dump_yaml(cfg))
        atomic_write_json(run.ds_config, ds_config, default=str)
        # Until the job writes how it ended: "running" left after it means a hard crash,
        # which the sbatch script does not requeue (a stale "interrupted" would be).
        run.write_status(RUNNING, info.step if info is not None else 0)
        # The resolved config is worth reading at every start; the DeepSpeed JSON is
        # derived from it, so it is only saved.
        print(f"memtrain: {env.world_size} rank(s) via {env.launcher}, run dir {run_dir}\n"
              f"--- resolved config ---\n{dump_yaml(cfg)}--- ds_config: saved in "
              f"{run_dir / 'ds_config.json'}", flush=True)

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model)
    engine, schedule = initialize(model, cfg, ds_config)
    if env.rank:
        # Dropout of its own on every other rank (rank 0 keeps the stream it always had):
        # ranks drawing identical masks would add correlated, not independent, noise. A
        # resume restores each rank's RNG state from its checkpoint file.
        torch.manual_seed(rank_seed(cfg.seed, env.rank))
    state = TrainState(plan=WindowPlan(cfg.bptt, manifest.kind == "episodes"))
    if info is not None:
        restore(info, engine, state, stream, env, device)  # the curriculum stage included
        if env.is_main:
            print(f"resumed from {info.path} at step {state.step}", flush=True)
    curriculum.start(resumed=info is not None)
    tracker = Tracker(run_dir, enabled=env.is_main, experiment=cfg.tracking.experiment,
                      run_name=cfg.name, tracking_uri=cfg.tracking.uri or None,
                      params={**cfg.to_dict(), "ds": ds_config,
                              "valid_protocol": asdict(protocol_for(
                                  cfg, split=cfg.data.valid_split)),
                              "final_protocol": asdict(protocol_for(cfg))},
                      tags={"model_type": "memory-augmented-lm",
                            "mechanism": cfg.model.mechanism, "git_commit": git_commit(),
                            "world_size": env.world_size,
                            "zero_stage": zero_stage(ds_config)},
                      use_mlflow=cfg.tracking.enabled)
    tracker.log_artifact(run_dir / "config.yaml", "config")
    tracker.log_artifact(run_dir / "ds_config.json", "config")
    loop = _Loop(cfg, env, device, engine, schedule, stream, manifest, state, tracker, ckpt_root,
                 zero_stage(ds_config), curriculum)
    try:
        status = loop.run()
    except BaseException:
        tracker.close("FAILED")
        if env.is_main:
            run.write_status("failed", state.step)
        raise
    tracker.close("FINISHED" if status == "finished" else "KILLED")
    if env.is_main:
        run.write_status(status, state.step)
    barrier()
    # Leave the process group explicitly: tearing gloo down at interpreter exit can abort a
    # rank ("terminate called without an active exception") after a successful run.
    torch.distributed.destroy_process_group()
    return 0


class _Loop:
    def __init__(self, cfg, env, device, engine, schedule, stream, manifest, state, tracker,
                 ckpt_root, stage, curriculum):
        self.cfg, self.env, self.device, self.engine = cfg, env, device, engine
        self.schedule, self.stream, self.manifest, self.state = schedule, stream, manifest, state
        self.tracker, self.ckpt_root, self.stage = tracker, ckpt_root, stage
        self.curriculum = curriculum
        self.signals = StopSignal()
        self.fp16 = cfg.deepspeed.precision == "fp16"
        self.grad_norm: torch.Tensor | None = None  # ZeRO-0 only: DeepSpeed keeps none

    # ------------------------------------------------------------------ one micro-step
    # This rank's sums since the last read, ON THE DEVICE: [nll, counted tokens, non-finite]
    # (class defaults: tests build the loop without __init__).
    _pending: torch.Tensor | None = None
    _pending_new = 0

    def _micro_step(self, batches) -> tuple[float, float, bool, int]:
        """One window, one backward: (nll sum, counted tokens, stop flag, new tokens), summed
        over all ranks and the micro-steps since the last read; zeros when this micro-step
        does not read (see `_read_flags`)."""
        window = self.state.plan.next_window(batches, self.state.memory)
        res = run_window(self.engine, window.start, window.segments, self.device,
                         counted=window.counted, detach_before=window.cuts,
                         checkpoint_segments=self.cfg.bptt.checkpoint_segments,
                         recompute=self.cfg.bptt.recompute,
                         keep_last_segments=self.cfg.bptt.keep_last_segments)
        # No host sync here: the window's sums and its non-finite flag stay on the device.
        sums = torch.stack([res.nll_sum.double(), res.n_tokens.double(),
                            (~torch.isfinite(res.loss.detach())).double()])
        p = self._pending
        self._pending = sums if p is None else torch.cat([p[:2] + sums[:2],
                                                          torch.maximum(p[2:], sums[2:])])
        self._pending_new += window.new_tokens
        self.engine.backward(res.loss)
        nll = n = 0.0
        bad = stop = new = 0
        # fp16: the next window's memory depends on this one being finite; otherwise the
        # flags are needed once per optimizer step, before its update.
        if self.fp16 or self.engine.is_gradient_accumulation_boundary():
            nll, n, bad, stop, new = self._read_flags()
        if bad and not self.fp16:
            raise NonFiniteLoss(
                f"non-finite loss at step {self.state.step + 1} on {int(bad)} rank(s); "
                "stopped before the update, so the last checkpoint is intact. Lower optim.lr, "
                "check the data, or use fp16 loss scaling on GPUs")
        # fp16: DeepSpeed skips the step (its gradients overflow), and nothing this window
        # produced is carried on: every row's memory restarts below (after_nonfinite), on
        # every rank alike since `bad` is all-reduced. A memory that held the NaN/Inf is then
        # gone, so the next window is finite again; a run of non-finite windows despite
        # fresh memory is an overflow loss scaling cannot cure (the scale multiplies the
        # loss after it is computed): stop, rather than skip steps until DeepSpeed's loss
        # scaler aborts at its minimum scale.
        limit = self.cfg.optim.max_nonfinite_steps
        self.state.nonfinite_in_a_row = self.state.nonfinite_in_a_row + 1 if bad else 0
        if bad and self.state.nonfinite_in_a_row >= limit:
            raise NonFiniteLoss(
                f"{limit} non-finite losses in a row under fp16 loss scaling (the last at "
                f"step {self.state.step + 1}), with every row's memory reset after each: the "
                "forward overflows fp16 or the weights are broken. Stopped before the update; "
                "DeepSpeed skipped those steps, so the last checkpoint is intact. Lower "
                "optim.lr, check the data, train in bf16 (A100) or fp32, or raise "
                "optim.max_nonfinite_steps")
        if bad:
            warnings.warn(f"non-finite loss at step {self.state.step + 1} on {int(bad)} "
                          f"rank(s) ({self.state.nonfinite_in_a_row} in a row; the run stops "
                          f"at {limit}): fp16 loss scaling skips this step and every row's "
                          "memory is reset", stacklevel=2)
        step, cfg = self.state.step + 1, self.cfg
        logs = step % cfg.log_every == 0 or step == cfg.max_steps
        if self.stage == 0 and logs and self.engine.is_gradient_accumulation_boundary():
            # Without ZeRO, DeepSpeed clips fp32 gradients itself and returns no norm; the
            # gradients are already all-reduced here, so every rank computes the same one.
            # Only on steps that log it: it is one more pass over every gradient. Kept on
            # the device until the log line reads it (after the step, not before it).
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            self.grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        self.engine.step()
        self.state.memory = (self.state.plan.after_nonfinite() if bad else
                             self.state.plan.after_step(window, res))
        return nll, n, bool(stop), int(new)

    def _read_flags(self) -> tuple[float, float, float, float, float]:
        """THE host sync of a training step (issue 14): one all-reduce of [nll sum, counted
        tokens, non-finite ranks, stop ranks, new tokens] and one read of it. It cannot go:
        every rank must stop (signal) at the same step, fp32/bf16 must stop before the
        update a non-finite loss would make, and under fp16 the next window's memory
        depends on it (after_nonfinite). It is read after the backward, so the device has
        the whole forward + backward queued while the host waits; the loss sums ride along
        for free (the logging steps then read nothing more). On a GPU,
        `torch.cuda.set_sync_debug_mode("warn")` around a step should report only this."""
        p, new = self._pending, float(self._pending_new)
        self._pending, self._pending_new = None, 0
        vec = p.new_empty(5)
        vec[:3] = p
        # Host scalars enter as fills (kernel arguments), not as a blocking host copy.
        vec[3].fill_(1.0 if self.signals.received else 0.0)
        vec[4].fill_(new)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(vec)
        nll, n, bad, stop, new = vec.tolist()
        return nll, n, bad, stop, new

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        st = self.state
        payload = {"step": st.step, "tokens_seen": st.tokens_seen,
                   "memory": None if st.memory is None else st.memory.to("cpu").state_dict(),
                   "history": st.plan.state_dict(), "stream": self.stream.state_dict(),
                   "rank": self.env.rank}
        meta = {"world_size": self.env.world_size, "zero_stage": self.stage,
                "global_batch": self.cfg.data.global_batch, "name": self.cfg.name,
                "mechanism": self.cfg.model.mechanism,
                # What the weights are: checked against the config that loads them later.
                "model": self.cfg.model.to_dict()}
        path = ckpt.save(self.engine, self.ckpt_root, st.step, self.env.rank, payload, meta,
                         self.cfg.keep_last)
        if self.env.is_main:
            print(f"saved checkpoint {path}", flush=True)

    # ------------------------------------------------------------------ evaluation
    def validate(self, split: str | None = None, final: bool = False) -> dict:
        cfg = self.cfg
        split = split or (cfg.eval.split if final else cfg.data.valid_split)
        proto = protocol_for(cfg, split=split)
        # During a curriculum, validation scores the stage being trained; the final
        # evaluation always scores the task's own segment count.
        stage = None if final else self.curriculum.segments
        report = evaluate(self.engine, self.engine.module, self.manifest, proto, self.env.rank,
                          self.env.world_size, self.device,
                          url_template=cfg.data.url_template, seed=cfg.data.seed,
                          n_segments=stage)
        prefix = "final" if final else "valid"
        metrics = {f"{prefix}_loss": report["loss"], f"{prefix}_bpc": report["bpc"],
                   f"{prefix}_ppl": report["ppl"]}
        if "accuracy" in report:
            metrics[f"{prefix}_accuracy"] = report["accuracy"]
        self.tracker.log_metrics(metrics, self.state.step)
        if self.env.is_main:
            print(f"[{prefix} step {self.state.step}] {headline(report)}", flush=True)
        if not final and self.schedule.report(report["loss"]) and self.env.is_main:
            print(f"plateau: lr lowered to {self.schedule.get_last_lr()[0]:.3g}", flush=True)
        if not final:
            self._stage_changed(self.curriculum.after_validation(report.get("accuracy")))
        return report

    def _stage_changed(self, segments: int | None) -> None:
        """A curriculum stage began: the task got harder, so the plateau schedule's best
        validation loss is forgotten; the new count is logged at its first step."""
        if segments is None:
            return
        self.schedule.restart_patience()
        self.tracker.log_metrics({"curriculum_segments": segments}, self.state.step + 1)
        if self.env.is_main:
            print(f"curriculum: {segments} segments per sample after step {self.state.step}",
                  flush=True)

    def final_reports(self) -> None:
        cfg = self.cfg
        reports = {"main": self.validate(final=True)}
        if cfg.eval.no_memory_baseline:
            proto = protocol_for(cfg, carry_memory=False)
            base = evaluate(self.engine, self.engine.module, self.manifest, proto,
                            self.env.rank, self.env.world_size, self.device,
                            url_template=cfg.data.url_template)
            reports["no_memory"] = base
            self.tracker.log_metrics({"final_loss_no_memory": base["loss"]}, self.state.step)
            if self.env.is_main:
                print(f"[same model, memory switched off] {headline(base)}", flush=True)
        reports["step"] = self.state.step
        self.tracker.log_json(reports, "eval_report.json")

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        cfg, st, env = self.cfg, self.state, self.env
        progress = Progress(cfg.max_steps, st.step, enabled=env.is_main)
        batches = iter(self.stream)
        self.engine.train()
        last_log, tokens_at_log = time.perf_counter(), st.tokens_seen
        loss_sum = loss_n = 0.0
        saved_at = st.step if st.step else -1
        stop = False
        while st.step < cfg.max_steps and not stop:
            for _ in range(cfg.deepspeed.grad_accum):
                nll, n, stop_now, new = self._micro_step(batches)
                loss_sum, loss_n, stop = loss_sum + nll, loss_n + n, stop or stop_now
                st.tokens_seen += new
            st.step += 1
            if st.step % cfg.log_every == 0 or st.step == cfg.max_steps:
                now = time.perf_counter()
                loss = loss_sum / max(loss_n, 1)
                metrics = {"loss": loss, "bpc": bits_per_token(loss),
                           "lr": self.schedule.get_last_lr()[0],
                           "tokens_per_s": (st.tokens_seen - tokens_at_log) / (now - last_log),
                           "peak_mem_mb": peak_memory_mb(self.device)}
                metrics.update(self.curriculum.metrics())
                if cfg.model.compile:  # graphs torch.compile built so far (model/compiled.py)
                    metrics["compiled_graphs"] = compiled_graphs()
                norm = self.engine.get_global_grad_norm() if self.stage else self.grad_norm
                if norm is not None:
                    metrics["grad_norm"] = float(norm)
                self.tracker.log_metrics(metrics, st.step)
                progress.update(st.step, metrics)
                last_log, tokens_at_log, loss_sum, loss_n = now, st.tokens_seen, 0.0, 0.0
            else:
                progress.update(st.step, None)
            if cfg.eval.every and st.step % cfg.eval.every == 0 and st.step < cfg.max_steps:
                self.validate()
            self._stage_changed(self.curriculum.after_step(st.step))
            if stop or (cfg.save_every and st.step % cfg.save_every == 0):
                self.save()
                saved_at = st.step
        progress.close()
        if stop and st.step < cfg.max_steps:
            if env.is_main:
                print(f"stop signal {self.signals.received} received: checkpointed at step "
                      f"{st.step}; the run resumes from there (memtrain train with the same "
                      "config)", flush=True)
            return "interrupted"
        if saved_at != st.step:
            self.save()
        self.final_reports()
        if env.is_main:
            out = export_checkpoint(ckpt.find_latest(self.ckpt_root), cfg.resolved_run_dir /
                                    "model.safetensors", cfg.model)
            print(f"exported {out}", flush=True)
        return "finished"


def main_entry(cfg: RunConfig, resume: bool | str) -> int:
    try:
        return train(cfg, resume)
    except (ConfigError, ShardError, LayoutError) as err:
        print(f"memtrain train: {err}", file=sys.stderr)
        return 2
    except NonFiniteLoss as err:
        print(f"memtrain train: {err}", file=sys.stderr)
        return 3
