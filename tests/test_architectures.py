"""Memory around every decoder-only causal LM transformers ships, taken by what it is
(model/pretrained/traits.py, probe.py), on a tiny random checkpoint of each architecture
built here from its config class (2 layers, d_model 32, vocabulary 48; never downloaded),
once per module:

- RMT's "causal" pattern is the base model's own forward on [mem; E(x); mem] (its logits'
  post-processing, embedding scale, MoE routing included), segment after segment;
- token rows are causal under RMT's "paper" pattern and ARMT: changing a later token
  changes no earlier log-probability;
- RMT, ARMT and Titans train: a two-segment window gives finite gradients reaching the
  memory;
- a Gemma-family and a mixture-of-experts model train through `memtrain train` with LoRA
  and resume exactly, the MoE's load-balancing loss logged apart;
- what cannot hold memory tokens is refused naming the property.
"""

import math

import pytest
import torch
import transformers
from pretrained_helpers import (
    COPY_STOP,
    TINY,
    authors_reference,
    make_copy_task,
    train_copy_task,
)
from train_helpers import step_losses

from data_pipeline.streams import SegmentBatch
from model import ConfigError, ModelConfig, build_model, resolve_shape
from train.bptt import run_window

V, D, M, L = 48, 32, 2, 6
_BASE = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
_WINDOW = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
# model_type -> (config class, its own fields): what each one brings to the wrapper.
ARCHS = {
    # learned absolute position tables
    "gpt2": ("GPT2Config", dict(n_embd=D, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neo": ("GPTNeoConfig", dict(num_layers=2, num_heads=4, window_size=4,   # no SDPA
                                     attention_types=[[["global", "local"], 1]])),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=D, n_layer=2, n_head=4, n_positions=64)),
    "opt": ("OPTConfig", dict(ffn_dim=2 * D, word_embed_proj_dim=D)),
    # rotary positions
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=32)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "smollm3": ("SmolLM3Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gptj": ("GPTJConfig", dict(n_embd=D, n_layer=2, n_head=4, n_positions=64,
                                rotary_dim=4)),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", {}),
    "stablelm": ("StableLmConfig", {}),           # attention outside transformers' functions
    "falcon": ("FalconConfig", dict(multi_query=True, new_decoder_architecture=False)),
    "starcoder2": ("Starcoder2Config", {}),
    "exaone4": ("Exaone4Config", _WINDOW),
    "helium": ("HeliumConfig", dict(head_dim=8)),
    "seed_oss": ("SeedOssConfig", dict(head_dim=8)),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=8)),
    # logits post-processed after the head; Gemma's scaled embeddings
    "granite": ("GraniteConfig", dict(logits_scaling=4.0)),               # divides
    "hyperclovax": ("HyperCLOVAXConfig", dict(logits_scaling=4.0)),       # multiplies
    "cohere": ("CohereConfig", dict(logit_scale=0.25)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, final_logit_softcapping=0.5, **_WINDOW)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, final_logit_softcapping=0.5,
                                             **_WINDOW)),
    # mixtures of experts, the routers' load-balancing loss in the forward's loss
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, **_MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=D,
                                         shared_expert_intermediate_size=D, **_MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=D, head_dim=8,
                                         **_MOE)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, **_MOE)),
    # routed experts whose forward adds no load-balancing loss; multi-head latent attention
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=D, n_group=1, topk_group=1,
                                             first_k_dense_replace=1, kv_lora_rank=8,
                                             q_lora_rank=8, qk_rope_head_dim=4,
                                             num_key_value_heads=4, output_router_logits=True,
                                             qk_nope_head_dim=4, v_head_dim=8)),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# model_type -> (config class, fields, the ConfigError field and message): refused.
REFUSED = {
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4), "model.hf.path",
              "'bloom': BloomModel.forward takes no position_ids"),
    "falcon-alibi": ("FalconConfig", dict(alibi=True, multi_query=True,
                                          new_decoder_architecture=False),
                     "model.hf.path", "'falcon': its config names ALiBi"),
    "gemma2-window": ("Gemma2Config", dict(head_dim=8, sliding_window=8,
                                           layer_types=["sliding_attention"] * 2),
                      "model.tgt_len", "beyond the 8-row sliding window of 'gemma2'"),
    "mamba": ("MambaConfig", dict(state_size=4, expand=2), "model.hf.path",
              "'mamba': MambaModel.forward takes no position_ids"),
    "xglm": ("XGLMConfig", dict(d_model=D, num_layers=2, ffn_dim=2 * D), "model.hf.path",
             "'xglm': its decoder under memtrain's causal attention .* does not reproduce"),
    "llama4_text": ("Llama4TextConfig", dict(head_dim=8, intermediate_size_mlp=2 * D,
                                             num_local_experts=2, num_experts_per_tok=1),
                    "model.hf.path", "'llama4_text': Llama4ForCausalLM names no decoder"),
    "gemma4_text": ("Gemma4TextConfig", dict(vocab_size_per_layer_input=V), "model.hf.path",
                    "'gemma4_text': its decoder does not run on input embeddings alone"),
}


def _write(root, name, spec):
    cls, fields = spec[:2]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**_BASE, **fields})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("archs"), {}

    def get(name):
        if name not in made:
            made[name] = _write(root, name, ARCHS.get(name) or REFUSED[name])
        return made[name]
    return get


def _section(path, mechanism, pattern="paper", **extra):
    section = {"mechanism": mechanism, "backbone": "hf", "tgt_len": L, "mem_len": 0,
               "hf": {"path": str(path)}, **extra}
    if mechanism == "rmt":
        section["rmt"] = {"num_mem_tokens": M, "pattern": pattern}
    if mechanism == "armt":
        section["armt"] = {"num_mem_tokens": M, "d_key": 8}
    if mechanism == "titans":
        section["titans"] = {"d_mem": 8, "chunk_size": 3, "num_persistent": 2}
    return section


@pytest.fixture(scope="module")
def models(ckpt):
    """(architecture, mechanism, pattern) -> the model, built once."""
    made = {}

    def get(arch, mechanism, pattern="paper"):
        key = (arch, mechanism, pattern)
        if key not in made:
            section = _section(ckpt(arch), mechanism, pattern)
            torch.manual_seed(0)
            made[key] = build_model(ModelConfig.from_dict(section))
        return made[key]
    return get


def _tokens(n_seg=2, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (rows, n_seg * L), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_rmt_causal_is_the_base_model_on_memory_then_segment_then_memory(models, arch):
    model = models(arch, "rmt", "causal").eval()
    tokens = _tokens()
    segments = list(tokens.split(L, dim=1))
    with torch.no_grad():
        ref = authors_reference(model.base, model.memory_init(), segments)
        state = None
        for seg, (logp, mem) in zip(segments, ref, strict=True):
            out = model(seg, state, return_log_probs=True)
            state = out.state
            torch.testing.assert_close(out.log_probs, logp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.tokens, mem, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_token_row_reads_a_later_token(models, arch):
    tokens = _tokens(n_seg=1, rows=1)
    other = tokens.clone()
    other[0, 4] = tokens[0, 4] % (V - 1) + 1
    for mechanism in ("rmt", "armt"):
        model = models(arch, mechanism).eval()
        with torch.no_grad():
            a = model(tokens, return_log_probs=True).log_probs
            b = model(other, return_log_probs=True).log_probs
        torch.testing.assert_close(a[0, :4], b[0, :4], rtol=0, atol=1e-6)
        assert not torch.allclose(a[0, 4:], b[0, 4:]), mechanism


@pytest.mark.parametrize("arch", ARCHS)
def test_rmt_armt_and_titans_train_with_finite_gradients(models, arch):
    tokens = _tokens(seed=1)
    segments = [SegmentBatch(torch.cat([s, s[:, :1]], dim=1), torch.zeros(2, dtype=torch.bool),
                             None, 0, j) for j, s in enumerate(tokens.split(L, dim=1))]
    own = {"rmt": "memory_init", "armt": "associative", "titans": "memory"}
    for mechanism, name in own.items():
        model = models(arch, mechanism).train()
        model.zero_grad()
        res = run_window(model, None, segments, torch.device("cpu"))
        res.loss.backward()
        assert math.isfinite(res.loss.item()), mechanism
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for _, g in grads), mechanism
        assert any(n.startswith(name) and g.abs().sum() > 0 for n, g in grads), mechanism
        # A mixture of experts adds its weighted load-balancing loss, as its forward does.
        assert (res.aux is not None) == (arch in MOE)


def test_the_balancing_loss_is_the_same_through_checkpointed_layers_and_segments(ckpt):
    """The router loss is made inside `decode`, which segment checkpointing recomputes, from
    router outputs inside layers that HF gradient checkpointing recomputes: loss, logged term
    and gradients as without either."""
    tokens = _tokens(seed=2)
    segments = [SegmentBatch(torch.cat([s, s[:, :1]], dim=1), torch.zeros(2, dtype=torch.bool),
                             None, 0, j) for j, s in enumerate(tokens.split(L, dim=1))]
    runs = []
    path = ckpt("mixtral")     # written before the seed: the memory's draws follow it
    for layers, whole in ((False, False), (True, True)):
        torch.manual_seed(0)
        model = build_model(ModelConfig.from_dict(
            _section(path, "armt", checkpoint_layers=layers))).train()
        res = run_window(model, None, segments, torch.device("cpu"),
                         checkpoint_segments=whole)
        res.loss.backward()
        runs.append((res.loss.detach(), res.aux, {n: p.grad for n, p in
                                                  model.named_parameters()}))
    (loss, aux, grads), (loss2, aux2, grads2) = runs
    assert torch.equal(loss, loss2) and torch.equal(aux, aux2) and float(aux) > 0
    assert grads["base.model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for name, g in grads.items():
        assert torch.equal(g, grads2[name]), name


@pytest.mark.parametrize("name", REFUSED)
def test_what_cannot_hold_memory_tokens_is_refused_naming_the_property(ckpt, name):
    field, message = REFUSED[name][2:]
    with pytest.raises(ConfigError, match=message) as err:
        resolve_shape(ModelConfig.from_dict(_section(ckpt(name), "rmt")))
        build_model(ModelConfig.from_dict(_section(ckpt(name), "rmt")))
    assert err.value.field == field


def test_a_segment_wider_than_a_sliding_window_is_refused_when_it_runs(ckpt):
    # Titans' 2L + P rows pass the config's count of positions (P + L = 8) but not the
    # window of 8 the decoder's rows are checked against as they run.
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(_section(ckpt("gemma2-window"), "titans")))
    with pytest.raises(ConfigError, match="14 rows through the decoder, beyond the 8-row "
                                          "sliding window") as err:
        model(_tokens(n_seg=1))
    assert err.value.field == "model.tgt_len"


def test_the_planner_counts_every_expert_of_a_mixture_of_experts(ckpt):
    """`memtrain plan` states Mixtral and Qwen2-MoE layers (model/pretrained/shapes.py):
    its parameter count, made on the meta device, is the built model's, every expert's
    weights included; Qwen3-MoE and OLMoE (their attention's q/k norms) are refused by
    name."""
    from planner.activations import count_params
    for arch in ("mixtral", "qwen2_moe"):
        cfg = resolve_shape(ModelConfig.from_dict(_section(ckpt(arch), "rmt")))
        torch.manual_seed(0)
        model = build_model(cfg)
        assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
        experts = model.base.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[0] == 4       # all E experts are parameters
    cfg = resolve_shape(ModelConfig.from_dict(_section(ckpt("olmoe"), "rmt")))
    with pytest.raises(ConfigError, match="no segment shapes for 'olmoe'"):
        count_params(cfg)


def test_the_probe_reads_positions_logits_attention_and_router(models):
    facts = {arch: models(arch, "rmt", "causal").base.memtrain_traits
             for arch in ("gpt2", "opt", "falcon", "granite", "hyperclovax", "gemma2",
                          "mixtral", "deepseek_v3")}
    assert facts["gpt2"].positions == facts["opt"].positions == "absolute"
    assert facts["gpt2"].table == 64
    assert facts["falcon"].attention == "mask" and facts["gpt2"].attention == "interface"
    # The same config field, two operations: the forward's logits decide.
    assert facts["granite"].logits == (("divide", 4.0),)
    assert facts["hyperclovax"].logits == (("multiply", 4.0),)
    assert facts["gemma2"].logits == (("softcap", 0.5),)
    assert facts["gemma2"].sliding_window == 16
    assert facts["mixtral"].moe.experts == 4 and facts["mixtral"].positions == "rotary"
    # Experts whose forward adds no load-balancing loss get none.
    assert facts["deepseek_v3"].moe is not None
    assert models("deepseek_v3", "rmt", "causal")._router is None
    assert all(t.checked for t in facts.values())
    # No SDPA path in transformers: the eager attention, said once in the log.
    from model.pretrained import loading
    assert models("gpt_neo", "rmt", "causal").base.config._attn_implementation == "eager"
    assert "gpt_neo" in loading._said_eager


def test_lora_on_fused_experts_adapts_the_expert_tensors(ckpt):
    section = _section(ckpt("mixtral"), "rmt", hf={
        "path": str(ckpt("mixtral")), "finetune": "lora", "lora_r": 2,
        "lora_targets": ["q_proj", "experts.gate_up_proj", "experts.down_proj"]})
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(section))
    trained = model.trained_parameter_names()
    assert any("experts.lora_A" in n for n in trained)
    section["hf"]["lora_targets"] = ["experts"]      # the module, not its tensors
    with pytest.raises(ConfigError, match="'experts.gate_up_proj'") as err:
        build_model(ModelConfig.from_dict(section))
    assert err.value.field == "model.hf.lora_targets"


@pytest.fixture(scope="module")
def copy_task(tmp_path_factory):
    return make_copy_task(tmp_path_factory.mktemp("copy") / "copy")


@pytest.mark.parametrize("arch", ["gemma", "mixtral"])
def test_lora_training_resumes_exactly(tmp_path, copy_task, monkeypatch, arch):
    path = TINY[arch](tmp_path / arch, d=32)
    model = {"mechanism": "rmt", "backbone": "hf", "tgt_len": 6, "mem_len": 0,
             "rmt": {"num_mem_tokens": 2},
             "hf": {"path": str(path), "finetune": "lora", "lora_r": 2}}
    whole = train_copy_task(tmp_path, copy_task, model, "whole", monkeypatch)
    stopped = train_copy_task(tmp_path, copy_task, model, "stopped", monkeypatch,
                              stop_at=COPY_STOP)
    assert sorted(step_losses(stopped)) == list(range(1, COPY_STOP + 1))
    train_copy_task(tmp_path, copy_task, model, "stopped", monkeypatch)
    assert step_losses(stopped) == step_losses(whole)
    aux = step_losses(whole, key="aux_loss")
    assert bool(aux) == (arch == "mixtral")
    assert all(0 < v < 1 for v in aux.values())
    assert step_losses(stopped, key="aux_loss") == aux


def test_the_initial_memory_is_drawn_at_the_scale_of_the_token_rows_the_decoder_sees(
        tmp_path):
    """Gemma multiplies its token embeddings by sqrt(d_model) inside the embedding module, so
    the rows among which the memory sits are that much larger than the weight's std: the
    memory is drawn at the rows' scale (with no such factor, at the weight's std)."""
    from pretrained_helpers import hf_model_section

    from model.pretrained.tiny import tiny_gemma, tiny_llama
    for make, factor in ((tiny_gemma, 64 ** 0.5), (tiny_llama, 1.0)):
        section = hf_model_section(make(tmp_path / make.__name__), 48, 8)
        torch.manual_seed(0)
        model = build_model(ModelConfig.from_dict(section))
        weight_std = float(model.base.get_input_embeddings().weight.float().std())
        drawn = float(model.memory_init().detach().float().std())   # 48 x 64 draws: ~2%
        assert drawn == pytest.approx(weight_std * factor, rel=0.1), make.__name__
