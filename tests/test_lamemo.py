"""LaMemo (Ji et al. 2022): look-ahead, interpolation in log space, state and gradients."""

import pytest
import torch
from reference import rel_score, softmax_attend, tiny_model

SEG, MEM, N_SEG = 4, 12, 5


def run(model, x, seg=SEG, train=False):
    state, outs = None, []
    for s in range(x.shape[1] // seg):
        out = model(x[:, s * seg:(s + 1) * seg], state, targets=x[:, s * seg:(s + 1) * seg])
        state, outs = out.state, outs + [out]
    return state, outs


def test_interpolated_memory_equals_one_softmax_over_causal_and_all_lookahead_keys():
    """Appendix A: with one layer (so q', k', v' = q, k, v) and tiny ε, the stored C↔ of a
    memory position p equals one softmax over its causal keys (those it saw as a target)
    and every look-ahead key p < j <= first token of the current segment, with v+ / R_{p-j}
    for the former and v− / R_{j-p} for the latter; log S is that softmax's normaliser."""
    model = tiny_model("lamemo", n_layer=1, mem_len=MEM, lamemo={"eps": 1e-30})
    torch.manual_seed(0)
    x = torch.randint(0, 23, (2, SEG * N_SEG))
    with torch.no_grad():
        state, _ = run(model, x)
        emb = model.embedding(x)  # = layer-1 input for every position (dropout 0)
        attn = model.core.layers[0].attn
        q = attn.q_net(emb).view(2, -1, 2, 8)
        k, v = attn.kv_net(emb).view(2, -1, 2, 2, 8).unbind(2)
    u, v_plus = model.core.biases(0)
    v_minus = model.core.v_bias_future
    first_current = SEG * (N_SEG - 1)
    n_total = SEG * N_SEG
    checked_refreshed = 0
    for p in range(n_total - MEM, n_total):
        seg_start = (p // SEG) * SEG
        causal = range(max(0, seg_start - MEM), p + 1)
        ahead = range(p + 1, first_current + 1) if p < first_current else range(0)
        checked_refreshed += len(ahead) > SEG  # refreshed at least twice
        for b in range(2):
            with torch.no_grad():
                scores = [rel_score(q[b, p], k[b, j], u, v_plus, attn.r_net.weight, p - j, 16)
                          for j in causal]
                scores += [rel_score(q[b, p], k[b, j], u, v_minus, attn.r_net.weight, j - p, 16)
                           for j in ahead]
                ctx, lse = softmax_attend(scores, [v[b, j] for j in [*causal, *ahead]])
            idx = p - (n_total - MEM)
            torch.testing.assert_close(state.context[0][b, idx], ctx, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state.log_norm[0][b, idx], lse, rtol=1e-5, atol=1e-5)
    assert checked_refreshed > 0


def test_memorizing_coefficient_alpha_lies_in_zero_one():
    model = tiny_model("lamemo", mem_len=8, n_layer=3)
    model.core.alpha_log = []
    with torch.no_grad():
        run(model, torch.randint(0, 23, (3, 24)))
    alphas = torch.cat([a.flatten() for a in model.core.alpha_log])
    assert alphas.numel() > 0
    assert (alphas >= 0).all() and (alphas <= 1).all()
    assert alphas.std() > 0  # not a constant: both past and future carry weight


def test_no_interpolation_ablation_sets_alpha_to_zero():
    model = tiny_model("lamemo", mem_len=8, lamemo={"interpolate": False})
    model.core.alpha_log = []
    with torch.no_grad():
        run(model, torch.randint(0, 23, (2, 16)))
    assert all((a == 0).all() for a in model.core.alpha_log)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_nan_or_inf_under_autocast_with_large_scores(dtype):
    model = tiny_model("lamemo", mem_len=8)
    with torch.no_grad():  # scores of order 1e4: exp() overflows fp16 and bf16 without logs
        for layer in model.core.layers:
            layer.attn.q_net.weight.mul_(30)
            layer.attn.kv_net.weight.mul_(30)
    x = torch.randint(0, 23, (2, 24))
    # CPU autocast supports both dtypes: nothing is skipped, and an error under autocast
    # (e.g. mixed dtypes in the interpolation) fails the test.
    with torch.autocast("cpu", dtype=dtype):
        state, outs = run(model, x)
    # The memory really went through `dtype` (else this would only re-test fp32).
    assert all(c.dtype == dtype for c in state.context)
    assert all(torch.isfinite(o.nll).all() for o in outs)
    assert all(torch.isfinite(c).all() for c in state.context)
    assert all(torch.isfinite(s).all() and s.dtype == torch.float32 for s in state.log_norm)


def test_stored_state_carries_no_gradient_but_lookahead_parameters_get_one():
    model = tiny_model("lamemo", mem_len=8, n_layer=2).train()
    x = torch.randint(0, 23, (2, 12))
    state, outs = run(model, x)
    tensors = [state.emb, *state.context, *state.log_norm]
    assert all(not t.requires_grad for t in tensors)
    outs[-1].loss.backward()
    # v− enters only the look-ahead branch (C← and log s←, hence α); its gradient reaching
    # the loss proves the refreshed memory of layer 1 feeds layer 2's keys and values.
    assert model.core.v_bias_future.grad is not None
    assert model.core.v_bias_future.grad.abs().sum() > 0


def test_without_lookahead_lamemo_is_exactly_transformer_xl():
    """Table 3: "w/o look-ahead" reproduces the XL numbers exactly, while the full LaMemo
    with the same shared weights does not (so this test can tell the two apart)."""
    xl = tiny_model("xl", mem_len=8, seed=3)
    ablated = tiny_model("lamemo", mem_len=8, seed=4, lamemo={"look_ahead": False})
    full = tiny_model("lamemo", mem_len=8, seed=4)
    ablated.load_state_dict(xl.state_dict())
    full.load_state_dict(xl.state_dict(), strict=False)  # v− stays its own
    x = torch.randint(0, 23, (2, 16))
    with torch.no_grad():
        a, b, c = (torch.cat([o.nll for o in run(m, x)[1]], 1) for m in (xl, ablated, full))
    torch.testing.assert_close(a, b)
    assert (a[:, SEG:] - c[:, SEG:]).abs().max() > 1e-3


def test_xl_position_ablation_changes_only_the_lookahead_branch():
    torch.manual_seed(0)
    x = torch.randint(0, 23, (2, 16))
    states = []
    for pos_enc in ("disentangled", "xl"):
        model = tiny_model("lamemo", mem_len=8, seed=5, lamemo={"pos_enc": pos_enc})
        with torch.no_grad():
            states.append(run(model, x)[0])
    # The newest segment's entries come from the causal branch only: identical. The older
    # entries were refreshed by look-ahead with R_|i-j| + v- versus R_{i-j} + v+: different.
    new, old = slice(8 - SEG, 8), slice(0, 8 - SEG)
    torch.testing.assert_close(states[0].context[0][:, new], states[1].context[0][:, new])
    diff = (states[0].context[0][:, old] - states[1].context[0][:, old]).abs().max()
    assert diff > 0.01 * states[0].context[0][:, old].abs().max()
