"""A pretrained Hugging Face causal LM with RMT memory tokens (model/pretrained/), on tiny
random GPT-2 (learned absolute positions) and Llama (RoPE, grouped-query attention)
checkpoints: the base model comes back exactly without memory tokens, the memory positions
and attention pattern are the stated ones, the memory carries gradient exactly as far as
the BPTT window lets it, and bad configs are refused by name."""

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section

from data_pipeline.streams import SegmentBatch
from model import ConfigError, ModelConfig, build_model, resolve_shape
from model.mechanisms.rmt.core import rmt_allowed
from model.pretrained.positions import memory_position_ids
from train.bptt import run_window

ARCHS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            made[key] = TINY[arch](root / name, **kw)
        return made[key]
    return get


def _model(path, m=4, tgt_len=8, **hf):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_dict(hf_model_section(path, m, tgt_len, **hf)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_with_no_memory_tokens_the_logits_are_the_base_models_exactly(ckpt, arch, attn):
    model = _model(ckpt(arch), m=0, attn_implementation=attn).eval()
    tokens = torch.randint(0, V, (3, 8))
    with torch.no_grad():
        ours = model(tokens, return_log_probs=True).log_probs
        base = torch.log_softmax(model.base(tokens).logits.float(), dim=-1)
    assert torch.equal(ours, base)


def test_granites_logits_scaling_is_applied_so_no_memory_tokens_give_the_base_logits(tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM
    torch.manual_seed(0)
    GraniteForCausalLM(GraniteConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        logits_scaling=8.0, bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "g")
    model = _model(tmp_path / "g", m=0).eval()
    tokens = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        ours = model(tokens, return_log_probs=True).log_probs
        base = torch.log_softmax(model.base(tokens).logits.float(), dim=-1)
    torch.testing.assert_close(ours, base)


def test_a_base_whose_forward_post_processes_its_logits_unknowingly_is_refused(ckpt):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(ckpt("llama"))
    forward = base.forward

    def scaled(*args, **kwargs):   # an architecture that rescales its logits after the head
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out
    base.forward = scaled
    cfg = ModelConfig.from_dict(hf_model_section(ckpt("llama"), m=0))
    with pytest.raises(ConfigError, match="'llama' post-processes its logits") as err:
        build_model(cfg, base=base)
    assert err.value.field == "model.hf.path"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_shape_fields_come_from_the_checkpoint_config(ckpt, arch):
    cfg = resolve_shape(ModelConfig.from_dict(hf_model_section(ckpt(arch))))
    assert cfg.hf.model_type == arch
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.n_head) == (V, 64, 2, 4)
    assert cfg.d_inner == (128 if arch == "llama" else 256)
    # The resolved config round-trips (what checkpoints and exports store).
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_memory_positions_read_first_tokens_next_write_at_a_fixed_place():
    m, T = 3, 8
    full = memory_position_ids(m, T, T)[0].tolist()
    assert full == [0, 1, 2] + list(range(3, 11)) + [11, 12, 13]
    for n_tok in (1, 5, 8):
        pos = memory_position_ids(m, n_tok, T)[0].tolist()
        assert pos[:m] == [0, 1, 2]
        assert pos[m:m + n_tok] == list(range(m, m + n_tok))
        assert pos[-m:] == [11, 12, 13]   # the write block does not move with L <= tgt_len
    # Longer than trained: the write block follows the text.
    assert memory_position_ids(m, 10, T)[0].tolist()[-m:] == [13, 14, 15]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_decoder_gets_the_stated_positions_and_attention_pattern(ckpt, arch):
    model = _model(ckpt(arch), m=3, attn_implementation="sdpa")
    seen = {}

    def grab(_module, _args, kwargs):
        seen.update(kwargs)
    model.base.base_model.register_forward_pre_hook(grab, with_kwargs=True)
    for n_tok in (8, 5):
        model(torch.randint(0, V, (2, n_tok)))
        assert seen["position_ids"].tolist() == [memory_position_ids(3, n_tok, 8)[0].tolist()] * 2
        table = rmt_allowed(3, n_tok, 0, None, False, "cpu")[0]
        assert torch.equal(seen["attention_mask"][0, 0], table)
        assert seen["inputs_embeds"].shape[1] == 2 * 3 + n_tok


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_are_causal_and_the_write_block_reads_the_whole_segment(ckpt, arch):
    """Changing token j changes no earlier token's prediction, and changes the memory that
    leaves the segment (the write rows see every token)."""
    model = _model(ckpt(arch), m=3, attn_implementation="eager").eval()
    tokens = torch.randint(0, V, (1, 8))
    other = tokens.clone()
    other[0, 5] = (other[0, 5] + 1) % V
    with torch.no_grad():
        a, b = model(tokens, return_log_probs=True), model(other, return_log_probs=True)
    assert torch.equal(a.log_probs[0, :5], b.log_probs[0, :5])
    assert not torch.allclose(a.log_probs[0, 5:], b.log_probs[0, 5:])
    assert not torch.allclose(a.state.tokens, b.state.tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_memory_carries_the_previous_segment_into_the_next(ckpt, arch):
    model = _model(ckpt(arch), m=3).eval()
    first, second = torch.randint(0, V, (2, 1, 8))
    flipped = first.clone()
    flipped[0, 0] = (flipped[0, 0] + 1) % V
    with torch.no_grad():
        a = model(second, model(first).state, return_log_probs=True)
        b = model(second, model(flipped).state, return_log_probs=True)
        fresh = model(second, model.initial_state(1), return_log_probs=True)
        reset = model(second, model(first).state.reset_rows(torch.tensor([True])),
                      return_log_probs=True)
    assert not torch.allclose(a.log_probs, b.log_probs)
    assert torch.equal(fresh.log_probs, reset.log_probs)


def _segments(n, rows=2):
    """Segment j uses only the token ids {2j, 2j+1}: the embedding rows that get gradient
    say which segments the loss reached."""
    g = torch.Generator().manual_seed(0)
    return [SegmentBatch(2 * j + torch.randint(0, 2, (rows, 9), generator=g),
                         torch.zeros(rows, dtype=torch.bool), None, 0, j) for j in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_reaches_exactly_the_segments_of_the_bptt_window(ckpt, arch):
    model = _model(ckpt(arch, tied=False), m=3)
    emb = model.base.get_input_embeddings().weight
    for cut, expect in ((set(), [True] * 4), ({2}, [False, False, True, True])):
        model.zero_grad()
        res = run_window(model, None, _segments(4), torch.device("cpu"),
                         counted=[False, False, False, True], detach_before=cut)
        res.loss.backward()
        assert [bool(emb.grad[2 * j:2 * j + 2].abs().sum() > 0) for j in range(4)] == expect
        # The learned initial memory enters segment 0 only: reached iff segment 0 is.
        assert bool(model.memory_init.value.grad.abs().sum() > 0) == expect[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_segment_checkpointing_gives_the_same_loss_and_gradients(ckpt, arch):
    grads = []
    for ckpt_segments in (False, True):
        model = _model(ckpt(arch), m=3)
        res = run_window(model, None, _segments(3), torch.device("cpu"),
                         checkpoint_segments=ckpt_segments)
        res.loss.backward()
        grads.append((res.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode, trained", [
    ("full", lambda n: True),
    ("frozen", lambda n: n == "memory_init.value"),
    ("lora", lambda n: n == "memory_init.value" or "lora_" in n),
])
def test_finetune_modes_train_the_memory_always_and_the_base_as_asked(ckpt, mode, trained):
    model = _model(ckpt("llama"), m=3, finetune=mode)
    names = [n for n, _ in model.named_parameters()]
    assert model.trained_parameter_names() == [n for n in names if trained(n)]
    if mode == "lora":
        assert any("lora_A" in n for n in names)
    res = run_window(model, None, _segments(2), torch.device("cpu"))
    res.loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == trained(n), n


def test_bad_pretrained_configs_are_refused_by_name(ckpt, tmp_path):
    path = ckpt("gpt2")
    cases = [
        ({"mem_len": 4}, "model.mem_len"),
        ({"mechanism": "xl"}, "model.mechanism"),
        ({"d_model": 128}, "model.d_model"),
        ({"tgt_len": 60}, "model.tgt_len"),       # 2m + L past GPT-2's 64 positions
        ({"hf": {"path": str(tmp_path / "missing")}}, "model.hf.path"),
        ({"hf": {"path": str(path), "finetune": "adapter"}}, "model.hf.finetune"),
    ]
    for change, field in cases:
        section = {**hf_model_section(path), **change}
        with pytest.raises(ConfigError) as err:
            resolve_shape(ModelConfig.from_dict(section))
        assert err.value.field == field, (change, err.value)


def test_a_hub_name_is_not_fetched_when_hf_hub_offline_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="cannot read the config of 'memtrain-test/absent'"):
        resolve_shape(ModelConfig.from_dict(hf_model_section("memtrain-test/absent")))


def test_memtrain_analyze_refuses_a_pretrained_backbone_by_name(ckpt, tmp_path):
    import yaml

    from evaluation.analyze_cli import analyze_run
    from train.config import load_config

    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump({"name": "hf", "model": hf_model_section(ckpt("gpt2")),
                                    "data": {"path": str(tmp_path / "data")}}))
    with pytest.raises(ConfigError) as err:
        analyze_run(load_config(path, []))
    assert err.value.field == "model.backbone"
