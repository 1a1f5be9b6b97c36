"""RMT's "paper" pattern as three maskless attention calls (model/pretrained/paper_attention.py).

- the split is the masked softmax of the pattern, written here from its definition (read rows
  see the read block; token rows the read block and the tokens up to themselves; write
  rows everything), in outputs and in gradients, with grouped key/value heads;
- around a pretrained decoder it gives the mask path's log-probs, next memory and
  gradients, and runs as three maskless calls per layer where the mask path runs one
  masked call; under `checkpoint_layers` and the eager kernel the mask path runs;
- a mode other than "split" or "mask" is refused naming the field.
(The default, the split, against the reference built cell by cell from the definition,
through the whole model: tests/test_rmt_paper_pattern.py; each planned as it runs:
tests/test_pretrained_plan.py.)"""

import sys

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section
from reference import rmt_paper_pattern
from torch.utils._python_dispatch import TorchDispatchMode

from model import ConfigError, ModelConfig, build_model
from model.pretrained.paper_attention import split_paper_attention

M, L = 3, 6


def _masked_softmax_attention(q, k, v, allowed):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("m,n", [(1, 1), (3, 6), (4, 13)])
def test_the_split_is_the_masked_softmax_of_the_pattern_with_its_gradients(m, n):
    g = torch.Generator().manual_seed(m * 100 + n)
    q = torch.randn(2, 4, 2 * m + n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 2 * m + n, 8, generator=g, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    w = torch.randn(2, 4, 2 * m + n, 8, generator=g, dtype=torch.float64)
    out = split_paper_attention(q, k, v, m, enable_gqa=True)
    ref = _masked_softmax_attention(q, k, v, rmt_paper_pattern(m, n))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class _AttentionCalls(TorchDispatchMode):
    """Counts the SDPA kernels run, and how many of them were given a mask."""

    def __init__(self):
        super().__init__()
        self.calls, self.masked = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and "backward" not in name:
            self.calls += 1
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.masked += isinstance(mask, torch.Tensor)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ("gpt2", "llama")}


def _model(path, mode, **cfg):
    section = hf_model_section(path, M, L, paper_attention=mode)
    section["rmt"]["pattern"] = "paper"
    section.update(cfg)
    torch.manual_seed(0)
    return build_model(ModelConfig.from_dict(section))


def _two_segments(model, x):
    out1 = model(x[:, :L], None, return_log_probs=True)
    out2 = model(x[:, L:], out1.state, return_log_probs=True)
    return torch.cat([out1.log_probs, out2.log_probs], dim=1), out2.state.tokens


@pytest.mark.parametrize("arch", ["gpt2", "llama"])   # llama: grouped key/value heads
def test_around_a_pretrained_decoder_the_split_gives_the_mask_paths_results(checkpoints, arch):
    x = torch.randint(0, V, (2, 2 * L), generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("split", "mask"):
        model = _model(checkpoints[arch], mode)
        with _AttentionCalls() as counted:
            logp, memory = _two_segments(model, x)
        (logp.sum() + memory.square().sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (logp, memory, grads, counted)
    (logp, memory, grads, split), (ref_logp, ref_memory, ref_grads, mask) = (
        results["split"], results["mask"])
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(memory, ref_memory, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and "memory" in " ".join(grads)
    for name in grads:   # fp32: sums in another order, so to the gradient's own scale
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-5 * scale)
    layers, segments = 2, 2
    assert (mask.calls, mask.masked) == (layers * segments, layers * segments)
    assert (split.calls, split.masked) == (3 * layers * segments, 0)


def test_layer_checkpointing_and_the_eager_kernel_run_the_mask(checkpoints):
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(2))
    for cfg in ({"checkpoint_layers": True}, {"hf_attn": "eager"}):
        impl = cfg.pop("hf_attn", None)
        section = hf_model_section(checkpoints["llama"], M, L, paper_attention="split",
                                   **({"attn_implementation": impl} if impl else {}))
        section["rmt"]["pattern"] = "paper"
        section.update(cfg)
        model = build_model(ModelConfig.from_dict(section)).train()
        with _AttentionCalls() as counted:
            model(x, None, return_log_probs=True)
        assert counted.calls == (0 if impl == "eager" else 2)
        assert counted.masked == counted.calls


def test_an_unknown_mode_is_refused_naming_the_field(checkpoints):
    section = hf_model_section(checkpoints["gpt2"], M, L, paper_attention="flash")
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(section)
    assert err.value.field == "model.hf.paper_attention"


def test_the_prepared_gpu_call_runs_here_and_reports_both_variants(tmp_path):
    """scripts/gpu_session.sh PAPER=1, with PAPER_ARGS shrinking it to the CPU: the split
    and the mask timed, the tiles each visits, and the two outputs' largest difference."""
    import json
    import os
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PAPER": "1", "PY": sys.executable,
           "PAPER_ARGS": "--seg 96 --mem 4 --heads 2 --head-dim 16 --tile 32"}
    subprocess.run(["bash", str(root / "scripts/gpu_session.sh"), str(tmp_path)], env=env,
                   check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "paper_attention.json").read_text())
    assert res["rows"] == 104 and set(res["step_s"]) == {"mask", "split"}
    assert all(t > 0 for t in res["step_s"].values())
    # 4 tiles of 32 rows: the causal call's 10 of 16 (its 100 rows), the read rows' 1, the
    # write rows' 4, against the mask's 16.
    assert res["tiles"] == {"mask": 16, "split": 15}
    assert res["max_abs_diff_forward"] < 1e-5
