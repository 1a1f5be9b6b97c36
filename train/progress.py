"""Progress on rank 0: a bar on a terminal, plain log lines in batch jobs (no terminal)."""

from __future__ import annotations

import resource
import sys
import time

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA's allocator peak on GPUs, the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Progress:
    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start_step, self.enabled = total, start, enabled
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def _eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        left = (time.perf_counter() - self.t0) / done * (self.total - step)
        return time.strftime("%H:%M:%S", time.gmtime(left))

    def update(self, step: int, metrics: dict | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if metrics:
                mfu = {"mfu": f"{metrics['mfu']:.1%}"} if "mfu" in metrics else {}
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                     tok_s=f"{metrics['tokens_per_s']:.0f}", **mfu)
        elif metrics:
            # MFU only where the device's peak is known (train/throughput.py): never a guess.
            mfu = f"MFU {metrics['mfu']:.1%} | " if "mfu" in metrics else ""
            # The largest single step's loss beside the mean, where it differs: a spike
            # shows in the line that holds it.
            top = metrics.get("loss_max", metrics["loss"])
            worst = f" (max step {top:.4f})" if top > metrics["loss"] * 1.5 else ""
            # A model's auxiliary loss term (a mixture of experts' balancing loss), apart.
            aux = f"aux {metrics['aux_loss']:.4f} | " if "aux_loss" in metrics else ""
            print(f"step {step}/{self.total} | loss {metrics['loss']:.4f}{worst} | lr "
                  f"{metrics['lr']:.3e} | {metrics['tokens_per_s']:.0f} tok/s | {mfu}"
                  f"grad norm {metrics.get('grad_norm', float('nan')):.3f} | {aux}peak "
                  f"{metrics['peak_mem_mb']:.0f} MB | eta {self._eta(step)}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
