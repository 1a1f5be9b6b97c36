"""The training loop of one rank: micro-steps (one BPTT window and one backward each) ->
optimizer steps, logging, validation, checkpoints and stop signals. `train.trainer.train`
builds everything it needs (engine, streams, tracker) and runs it.

Per optimizer step, each of the `grad_accum` micro-steps runs one BPTT window (bptt.py) and
makes exactly one backward. The loss sums and a non-finite flag stay on the device; after the
backward of the step's last micro-step (of every micro-step under fp16), one all-reduce
gathers them with a stop flag (SIGTERM / SIGUSR1) and is read once: the step's only host
sync (tests/test_sync_free.py counts them), so every rank takes the same decision at
the same step boundary: skip under fp16 loss scaling, stop cleanly otherwise, or checkpoint
and leave.
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model import bits_per_token
from model.compiled import compiled_graphs

from . import checkpoint as ckpt
from .bptt import run_window
from .evaluate import evaluate, headline, protocol_for
from .export import export_checkpoint
from .master_weights import fp32_master_model, gathers_masters, scored_weights
from .progress import Progress, peak_memory_mb
from .run_dir import RunDir
from .throughput import Throughput

if TYPE_CHECKING:
    from data_pipeline.shards import Manifest

    from .bptt import TrainState
    from .config import RunConfig
    from .curriculum import NoCurriculum, SegmentCurriculum
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


@dataclass
class LoopParts:
    """What one rank's loop works with, built by `train.trainer.train`. The first five are
    what every step reads; a test that runs only part of the loop (one micro-step, steps
    without checkpoints or evaluation) leaves out what that part never reads."""

    cfg: RunConfig
    engine: Any                           # the DeepSpeed engine (forward, backward, step)
    state: TrainState                     # step, memory, window plan: what is checkpointed
    device: torch.device
    stage: int                            # ZeRO stage (0: the loop computes the grad norm)
    env: Any = None                       # train.distributed's environment: rank, world size
    schedule: Any = None                  # the learning-rate schedule (logged)
    stream: Any = None                    # this rank's TokenStream / EpisodeStream
    manifest: Manifest | None = None      # the data, for the evaluations
    tracker: Tracker | None = None
    ckpt_root: Path | None = None         # RunDir.checkpoints
    curriculum: SegmentCurriculum | NoCurriculum | None = None   # the data regime's
    signals: Any = None                   # None: StopSignal() (SIGTERM, SIGUSR1 handlers)


class TrainingLoop:
    """One rank's loop over optimizer steps; `run()` returns how it ended: "finished" or
    "interrupted" (a stop signal: checkpointed, to be resumed)."""

    def __init__(self, parts: LoopParts):
        self.cfg, self.env, self.device, self.engine = (parts.cfg, parts.env, parts.device,
                                                        parts.engine)
        self.schedule, self.stream, self.manifest = parts.schedule, parts.stream, parts.manifest
        self.state, self.tracker, self.ckpt_root = parts.state, parts.tracker, parts.ckpt_root
        self.stage, self.curriculum = parts.stage, parts.curriculum
        self.signals = parts.signals if parts.signals is not None else StopSignal()
        self.fp16 = self.cfg.deepspeed.precision == "fp16"
        self.grad_norm: torch.Tensor | None = None  # ZeRO-0 only: DeepSpeed keeps none
        # This rank's sums since the last read, ON THE DEVICE: [nll, counted tokens,
        # non-finite], and the new tokens of those micro-steps.
        self._pending: torch.Tensor | None = None
        self._pending_new = 0
        # The model's auxiliary loss term (train/bptt.py `WindowResult.aux`) since the last
        # log line: the sum read with the flags (over ranks), and this rank's windows with
        # one; logged apart from the LM loss as "aux_loss" when any window had one.
        self._aux_sum, self._aux_windows = 0.0, 0
        # Per-layer minima the model keeps on the device (`take_read_minimum`: ARMT's
        # smallest relative read denominator, model/mechanisms/armt/associative.py), read with the
        # step's flags and kept on the host until a log line names them ("read_den_min/<layer>",
        # this rank's reads).
        self._minima_sources = [m for m in self.engine.module.modules()
                                if hasattr(m, "take_read_minimum")]
        self._pending_min: torch.Tensor | None = None
        self._logged_min = [math.inf] * len(self._minima_sources)
        # What the final report scores, chosen once (_scored).
        self._final_scored: tuple | None = None
        # Model FLOPs of this rank's windows, counted on the host from their shapes: the
        # MFU beside tokens/s (train/throughput.py).
        self.throughput = Throughput(self.cfg, self.device)

    # ------------------------------------------------------------------ one micro-step

    def _micro_step(self, batches) -> tuple[float, float, bool, int]:
        """One window, one backward: (nll sum, counted tokens, stop flag, new tokens), summed
        over all ranks and the micro-steps since the last read; zeros when this micro-step
        does not read (see `_read_flags`)."""
        window = self.state.plan.next_window(batches, self.state.memory)
        self.throughput.add(window.segments)
        res = run_window(self.engine, window.start, window.segments, self.device,
                         counted=window.counted, detach_before=window.cuts,
                         checkpoint_segments=self.cfg.bptt.checkpoint_segments,
                         recompute=self.cfg.bptt.recompute,
                         keep_last_segments=self.cfg.bptt.keep_last_segments)
        # No host sync here: the window's sums and its non-finite flag stay on the device.
        aux = (res.aux.double() if res.aux is not None
               else res.nll_sum.new_zeros((), dtype=torch.double))
        sums = torch.stack([res.nll_sum.double(), res.n_tokens.double(), aux,
                            (~torch.isfinite(res.loss.detach())).double()])
        p = self._pending
        self._pending = sums if p is None else torch.cat([p[:3] + sums[:3],
                                                          torch.maximum(p[3:], sums[3:])])
        self._pending_new += window.new_tokens
        self._aux_windows += res.aux is not None
        if self._minima_sources:
            lows = [m.take_read_minimum() for m in self._minima_sources]
            inf = sums.new_full((), math.inf)
            lows = torch.stack([inf if x is None else x.to(inf) for x in lows])
            q = self._pending_min
            self._pending_min = lows if q is None else torch.minimum(q, lows)
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
        self._engine_step(step)
        self.state.memory = (self.state.plan.after_nonfinite() if bad else
                             self.state.plan.after_step(window, res))
        return nll, n, bool(stop), int(new)

    def _engine_step(self, step: int) -> None:
        """engine.step(); DeepSpeed's fp16 loss scaler raises a bare Exception when gradients
        overflow at its minimum scale (a finite loss whose gradients do not fit fp16, which
        the loss check above cannot see): named here, with what to change."""
        try:
            self.engine.step()
        except Exception as err:
            if "loss scale already at minimum" not in str(err):
                raise
            raise NonFiniteLoss(
                f"fp16 gradients overflowed at DeepSpeed's minimum loss scale at step {step} "
                "(min_loss_scale in the DeepSpeed config's fp16 section, default 1): the update "
                "was skipped, so the last checkpoint is intact. Lower optim.lr, check the "
                "data, or train in bf16 (A100) or fp32") from err

    def _read_flags(self) -> tuple[float, float, float, float, float]:
        """THE host sync of a training step (tests/test_sync_free.py): one all-reduce of [nll
        sum, counted tokens, auxiliary loss sum, non-finite ranks, stop ranks, new tokens]
        and one read of it (the auxiliary sum is kept for the log line). It
        cannot go: every rank must stop (signal) at the same step, fp32/bf16 must stop before the
        update a non-finite loss would make, and under fp16 the next window's memory
        depends on it (after_nonfinite). It is read after the backward, so the device has
        the whole forward + backward queued while the host waits; the loss sums ride along
        for free (the logging steps then read nothing more). On a GPU,
        `torch.cuda.set_sync_debug_mode("warn")` around a step should report only this."""
        p, new = self._pending, float(self._pending_new)
        self._pending, self._pending_new = None, 0
        lows, self._pending_min = self._pending_min, None
        vec = p.new_empty(6 + (0 if lows is None else len(lows)))
        vec[:4] = p
        # Host scalars enter as fills (kernel arguments), not as a blocking host copy.
        vec[4].fill_(1.0 if self.signals.received else 0.0)
        vec[5].fill_(new)
        if lows is not None:
            vec[6:] = lows          # this rank's: read with the flags, not summed
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(vec[:6])
        nll, n, aux, bad, stop, new, *minima = vec.tolist()
        self._aux_sum += aux
        self._logged_min = [min(a, b) for a, b in zip(self._logged_min, minima, strict=False)]
        return nll, n, bad, stop, new

    def _minima_metric(self) -> dict[str, float]:
        """{"read_den_min/<i>": the smallest since the last log line, per layer i} for the
        layers that read; {} for a model without such minima."""
        out = {f"read_den_min/{i}": v for i, v in enumerate(self._logged_min)
               if math.isfinite(v)}
        self._logged_min = [math.inf] * len(self._minima_sources)
        return out

    def _aux_metric(self) -> dict[str, float]:
        """{"aux_loss": the mean auxiliary loss term of the windows since the last log line
        (over ranks: every rank runs as many windows)}, or {} for a model without one."""
        windows, self._aux_windows = self._aux_windows, 0
        total, self._aux_sum = self._aux_sum, 0.0
        if not windows:
            return {}
        world = (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                 else 1)
        return {"aux_loss": total / (windows * world)}

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
    def _scored(self, final: bool) -> tuple:
        """(forward, module, weights) an evaluation scores. Validations score the engine's
        module, the training copy (ZeRO-3 gathers its parameters in the engine's hooks). The
        final report of a bf16/fp16 run scores a plain model of DeepSpeed's fp32 master
        weights instead, gathered from the optimizer once (train/master_weights.py): the
        weights the checkpoint, `memtrain export` and `memtrain eval` hold (except where
        `gathers_masters` says a whole model would not fit: a sharded pretrained base)."""
        precision = self.cfg.deepspeed.precision
        training_copy = (self.engine, self.engine.module, scored_weights(precision, False))
        if precision == "fp32" or not final or not gathers_masters(self.cfg.model, self.stage):
            return training_copy
        if self._final_scored is None:
            model = fp32_master_model(self.engine, self.cfg.model, self.device)
            if model is None:
                warnings.warn(f"no fp32 master weights found in DeepSpeed's "
                              f"{type(self.engine.optimizer).__name__}: the final report "
                              f"scores the {precision} training copy", stacklevel=2)
            self._final_scored = training_copy if model is None else (
                model, model, scored_weights(precision, True))
        return self._final_scored

    def validate(self, split: str | None = None, final: bool = False) -> dict:
        cfg = self.cfg
        split = split or (cfg.eval.split if final else cfg.data.valid_split)
        forward, module, weights = self._scored(final)
        proto = protocol_for(cfg, split=split, weights=weights)
        # During a curriculum, validation scores the stage being trained; the final
        # evaluation always scores the task's own segment count.
        stage = None if final else self.curriculum.segments
        report = evaluate(forward, module, self.manifest, proto, self.env.rank,
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
            forward, module, weights = self._scored(final=True)
            proto = protocol_for(cfg, carry_memory=False, weights=weights)
            base = evaluate(forward, module, self.manifest, proto,
                            self.env.rank, self.env.world_size, self.device,
                            url_template=cfg.data.url_template)
            reports["no_memory"] = base
            self.tracker.log_metrics({"final_loss_no_memory": base["loss"]}, self.state.step)
            if self.env.is_main:
                print(f"[same model, memory switched off] {headline(base)}", flush=True)
        reports["step"] = self.state.step
        self._final_scored = None      # the fp32 model's memory back before the export
        self.tracker.log_json(reports, RunDir.EVAL_REPORT)

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        cfg, st, env = self.cfg, self.state, self.env
        progress = Progress(cfg.max_steps, st.step, enabled=env.is_main)
        if env.is_main and self.throughput.note:
            print(self.throughput.note, flush=True)
        batches = iter(self.stream)
        self.engine.train()
        last_log, tokens_at_log = time.perf_counter(), st.tokens_seen
        loss_sum = loss_n = 0.0
        # The largest loss of one optimizer step since the last log line (its tokens over
        # all ranks): a mean over log_every steps hides a single step gone wrong, which
        # under bf16/fp16 on a GPU is an overflow (docs/armt.md, "Loss spikes").
        loss_max = -math.inf
        saved_at = st.step if st.step else -1
        stop = False
        while st.step < cfg.max_steps and not stop:
            step_nll = step_n = 0.0
            for _ in range(cfg.deepspeed.grad_accum):
                nll, n, stop_now, new = self._micro_step(batches)
                step_nll, step_n, stop = step_nll + nll, step_n + n, stop or stop_now
                st.tokens_seen += new
            loss_sum, loss_n = loss_sum + step_nll, loss_n + step_n
            if step_n:
                loss_max = max(loss_max, step_nll / step_n)
            st.step += 1
            if st.step % cfg.log_every == 0 or st.step == cfg.max_steps:
                now = time.perf_counter()
                loss = loss_sum / max(loss_n, 1)
                metrics = {"loss": loss, "loss_max": loss_max if loss_n else loss,
                           "bpc": bits_per_token(loss),
                           "lr": self.schedule.get_last_lr()[0],
                           "tokens_per_s": (st.tokens_seen - tokens_at_log) / (now - last_log),
                           "peak_mem_mb": peak_memory_mb(self.device),
                           **self.throughput.read(now - last_log)}
                metrics.update(self.curriculum.metrics())
                metrics.update(self._aux_metric())
                metrics.update(self._minima_metric())
                if cfg.model.compile:  # graphs torch.compile built so far (model/compiled.py)
                    metrics["compiled_graphs"] = compiled_graphs()
                norm = self.engine.get_global_grad_norm() if self.stage else self.grad_norm
                if norm is not None:
                    metrics["grad_norm"] = float(norm)
                self.tracker.log_metrics(metrics, st.step)
                progress.update(st.step, metrics)
                last_log, tokens_at_log, loss_sum, loss_n = now, st.tokens_seen, 0.0, 0.0
                loss_max = -math.inf
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
            out = export_checkpoint(ckpt.find_latest(self.ckpt_root),
                                    RunDir(cfg.resolved_run_dir).exported, cfg.model)
            print(f"exported {out}", flush=True)
        return "finished"
