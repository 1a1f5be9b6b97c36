"""The loss backend (`model.loss_backend`, model/fused_loss.py): which path computes the
per-row NLL, and that a fused library's per-row NLL reaches the model's loss exactly where the
chunked path's does. Neither library nor a GPU is here: a fake module stands in for each
library (its NLL written from the definition, so it is the chunked path's to rounding), and
`fused_loss.device_type`, the dispatch's one device check, is replaced to take the CUDA branch
with CPU tensors. The real kernels against the chunked path are benchmarks/bench_loss.py's
`--fused` on CUDA (scripts/gpu_session.sh LOSS=1)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from pretrained_helpers import TINY, hf_model_section

import model.fused_loss as fl
from model import ConfigError, ModelConfig, build_model
from model.fused_loss import LinearHead, fused_rows, linear_head, softmax_head
from model.loss import logits_nll, segment_nll


class FakeLibrary:
    """Records each call; returns the float32 NLL of hidden @ weight.T (+ bias)."""

    def __init__(self):
        self.calls = []

    def nll(self, hidden, weight, targets, bias=None, reduction="mean", **kw):
        assert reduction == "none"
        self.calls.append({"rows": hidden.shape[0], "kw": kw, "bias": bias is not None})
        return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets,
                               reduction="none")


@pytest.fixture
def fakes(monkeypatch):
    """Fake `cut_cross_entropy` and `liger_kernel` modules (Liger at 0.8.5)."""
    cce, liger = FakeLibrary(), FakeLibrary()
    mod = types.ModuleType("cut_cross_entropy")
    mod.linear_cross_entropy = lambda e, c, t, **kw: cce.nll(e, c, t, **kw)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", mod)
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger.nll
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    monkeypatch.setattr(fl, "installed_version", lambda dist: (0, 8, 5))
    return {"cce": cce, "liger": liger}


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(fl, "device_type", lambda t: "cuda")


def _missing(monkeypatch, *modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)   # import raises ImportError


def _head(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 13, bias=bias)
    return lin, linear_head(lin)


# ---- which path ---------------------------------------------------------------------------

def test_auto_takes_the_chunked_path_off_cuda_even_with_a_library_installed(fakes):
    _, head = _head(bias=False)
    assert fused_rows("auto", head, torch.randn(4, 8)) is None
    assert fused_rows("chunked", head, torch.randn(4, 8)) is None


@pytest.mark.parametrize("bias,picked", [(False, "cce"), (True, "liger")])
def test_auto_on_cuda_takes_an_importable_library_cce_first_where_the_head_has_no_bias(
        fakes, on_cuda, bias, picked):
    lin, head = _head(bias)
    rows = fused_rows("auto", head, torch.randn(4, 8))
    t = torch.tensor([1, 2, 3, 12])
    assert rows is not None
    out = rows(torch.randn(4, 8), t)
    assert out.dtype == torch.float32 and out.shape == (4,)
    assert len(fakes[picked].calls) == 1 and not fakes[{"cce": "liger", "liger": "cce"}[picked]
                                                         ].calls
    if picked == "cce":   # the paper's gradient filtering off: exact gradients
        assert fakes["cce"].calls[0]["kw"]["filter_eps"] is None
    else:
        assert fakes["liger"].calls[0]["bias"]


def test_auto_on_cuda_falls_back_to_chunks_without_a_library_or_a_plain_head(
        fakes, on_cuda, monkeypatch):
    _, head = _head(bias=False)
    assert fused_rows("auto", "the head is a LoraLinear", torch.randn(4, 8)) is None
    assert fused_rows("auto", head, torch.randn(4, 8, dtype=torch.float64)) is None  # dtype
    monkeypatch.setattr(fl, "installed_version", lambda dist: (0, 8, 1))   # old Liger
    _missing(monkeypatch, "cut_cross_entropy")
    assert fused_rows("auto", head, torch.randn(4, 8)) is None
    _missing(monkeypatch, "liger_kernel.transformers.functional")
    assert fused_rows("auto", head, torch.randn(4, 8)) is None
    assert not fakes["cce"].calls and not fakes["liger"].calls


@pytest.mark.parametrize("backend,extra", [("cce", "cce"), ("liger", "liger")])
def test_an_explicit_backend_is_refused_in_one_line_when_it_cannot_run(
        backend, extra, fakes, monkeypatch):
    _, head = _head(bias=False)
    with pytest.raises(ConfigError, match="CUDA only") as cpu:
        fused_rows(backend, head, torch.randn(4, 8))
    monkeypatch.setattr(fl, "device_type", lambda t: "cuda")
    _missing(monkeypatch, {"cce": "cut_cross_entropy",
                           "liger": "liger_kernel.transformers.functional"}[backend])
    with pytest.raises(ConfigError, match="does not import") as missing:
        fused_rows(backend, head, torch.randn(4, 8))
    with pytest.raises(ConfigError, match="LoraLinear") as not_plain:
        fused_rows(backend, "the head is a LoraLinear", torch.randn(4, 8))
    for err in (cpu, missing, not_plain):
        msg = str(err.value)
        assert err.value.field == "model.loss_backend" and "\n" not in msg
        assert f"pip install 'memtrain[{extra}]'" in msg


def test_liger_older_than_0_8_2_is_refused_and_cce_refuses_a_bias(fakes, on_cuda,
                                                                   monkeypatch):
    _, plain = _head(bias=False)
    _, biased = _head(bias=True)
    with pytest.raises(ConfigError, match="no head bias"):
        fused_rows("cce", biased, torch.randn(4, 8))
    assert fused_rows("liger", biased, torch.randn(4, 8)) is not None
    monkeypatch.setattr(fl, "installed_version", lambda dist: (0, 8, 1))
    with pytest.raises(ConfigError, match="older than 0.8.2"):
        fused_rows("liger", plain, torch.randn(4, 8))


def test_only_a_plain_materialised_linear_head_without_hooks_is_a_linear_head():
    lin, head = _head(bias=True)
    assert head.weight is lin.weight and head.bias is lin.bias

    class Wrapped(torch.nn.Linear):   # a LoRA layer subclasses nn.Linear
        pass
    assert "Wrapped" in linear_head(Wrapped(8, 13))
    hooked = torch.nn.Linear(8, 13)
    hooked.register_forward_pre_hook(lambda m, a: None)   # ZeRO-3 gathers in such a hook
    assert "hooks" in linear_head(hooked)
    assert "materialised" in linear_head(torch.nn.Linear(8, 13, device="meta"))
    tied = torch.nn.Linear(8, 13, bias=False)
    tied.weight = torch.nn.Embedding(13, 8).weight          # tied to an embedding: fine
    assert isinstance(linear_head(tied), LinearHead)


# ---- what it computes ---------------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True])
def test_the_fused_nll_lands_where_the_chunked_one_does_with_the_same_gradients(
        fakes, on_cuda, masked):
    lin, head = _head(bias=False)
    hidden = torch.randn(2, 5, 8)
    targets = torch.randint(0, 13, (2, 5))
    mask = torch.tensor([[1, 0, 0, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool) if masked \
        else None

    def run(fused):
        h = hidden.clone().requires_grad_()
        nll = segment_nll(lambda x, t: logits_nll(lin(x), t), h, targets, mask, 3, fused)
        grads = torch.autograd.grad((nll * torch.arange(10.).view(2, 5)).sum(),
                                    [h, lin.weight])
        return nll.detach(), grads

    ref, ref_grads = run(None)
    ours, grads = run(fused_rows("cce", head, hidden))
    assert fakes["cce"].calls[0]["rows"] == (4 if masked else 10)   # supervised rows only
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    if masked:
        assert (ours[~mask] == 0).all() and (ours[mask] > 0).all()
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_no_supervised_rows_take_the_chunks_not_the_library(fakes, on_cuda):
    lin, head = _head(bias=False)
    nll = segment_nll(lambda x, t: logits_nll(lin(x), t), torch.randn(1, 4, 8),
                      torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.bool),
                      3, fused_rows("cce", head, torch.randn(1, 8)))
    assert (nll == 0).all() and not fakes["cce"].calls


def _score(model, backend, mask):
    model.cfg.loss_backend = backend
    torch.manual_seed(1)
    tokens = torch.randint(0, 29, (2, 6))
    targets = torch.randint(0, 29, (2, 6))
    return model(tokens, model.initial_state(2), targets=targets, loss_mask=mask).nll.detach()


def test_the_native_model_scores_through_the_library_exactly_as_through_the_chunks(
        fakes, on_cuda):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=29, n_layer=1, d_model=16, n_head=2,
                                    d_inner=32, dropout=0.0, tgt_len=6, mem_len=0)).eval()
    assert isinstance(softmax_head(model.softmax), LinearHead)
    mask = torch.rand(2, 6) < 0.5
    ref = _score(model, "chunked", mask)
    ours = _score(model, "liger", mask)   # the native softmax has a bias: Liger
    assert len(fakes["liger"].calls) == 1
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_the_pretrained_model_scores_through_the_library_and_a_padded_head_through_chunks(
        fakes, on_cuda, tmp_path):
    path = TINY["gpt2"](tmp_path / "gpt2")
    model = build_model(ModelConfig.from_dict(hf_model_section(path, 2, 6))).eval()
    ref = _score(model, "chunked", None)
    ours = _score(model, "auto", None)
    assert len(fakes["cce"].calls) == 1                 # GPT-2's head has no bias
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    model.cfg.hf.vocab_multiple = 64                    # the padded GEMM: chunks
    _score(model, "auto", None)
    assert len(fakes["cce"].calls) == 1


# ---- the option -----------------------------------------------------------------------------

@pytest.mark.parametrize("section,match", [
    ({"loss_backend": "fast"}, "unknown 'fast'"),
    ({"loss_backend": "cce"}, "no head bias"),
    ({"loss_backend": "liger", "cutoffs": [10], "vocab_size": 29}, "clusters"),
])
def test_the_option_refuses_a_bad_value_naming_the_field(section, match):
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig.from_dict(section)
    assert err.value.field == "model.loss_backend"
    assert ModelConfig(loss_backend="liger").to_dict()["loss_backend"] == "liger"


def test_an_explicit_backend_with_the_padded_head_is_refused(tmp_path):
    section = hf_model_section(tmp_path, 2, 6, vocab_multiple=128)
    section["loss_backend"] = "liger"
    with pytest.raises(ConfigError, match="vocab_multiple") as err:
        ModelConfig.from_dict(section)
    assert err.value.field == "model.loss_backend"


def test_the_benchmark_compares_a_fused_library_with_the_chunked_path(fakes, on_cuda):
    """benchmarks/bench_loss.py's fused variants on CUDA: the fake's bf16 head + float32
    cross-entropy is the chunked path's own arithmetic (no difference), and both differ from
    the float32 reference by bf16 rounding."""
    from benchmarks.bench_loss import compare
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, 10, 8, dtype=torch.bfloat16)
    targets, mask = torch.randint(0, 13, (1, 10)), torch.rand(1, 10) < 0.7
    out = compare(head, hidden, targets, mask, fused_rows("cce", linear_head(head), hidden))
    assert fakes["cce"].calls and set(out["vs_chunked"]) == {"nll", "grad_hidden",
                                                             "grad_weight"}
    assert out["vs_chunked"]["nll"] == 0 and out["vs_chunked"]["grad_hidden"] == 0
    assert 0 < out["chunked_vs_fp32"]["grad_weight"] < 0.05
    assert out["fused_vs_fp32"] == out["chunked_vs_fp32"]
