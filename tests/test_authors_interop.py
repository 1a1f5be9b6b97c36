"""Weights in and out (train/interop.py, model/pretrained/authors_format.py): a state dict
in the RMT authors' layout, built here from the stated key names and shapes, imports into a
model that reproduces the authors' loop (tests/pretrained_helpers.py `authors_reference`);
the authors' layout and a peft adapter written by `memtrain export` reproduce memtrain's
log-probs when run by that loop; `init_from` starts a run from an import."""

import json

import pytest
import torch
from pretrained_helpers import TINY, V, authors_reference, hf_model_section

from model import ModelConfig, build_model
from model.io import load_initial, load_model, read_config, save_model
from train.cli import main_export, main_import
from train.interop import MEMORY_CONFIG, MEMORY_FILE, export_peft, read_state_dict

M, L = 3, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch, tokenizer=True) for arch in ("gpt2", "llama")}


def _segments(n=(8, 8, 5)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (2, k), generator=g) for k in n]


def authors_checkpoint(base_dir, path, seed=0):
    """What `torch.save(RecurrentWrapper(MemoryCell(base, m), segment_size=L).state_dict())`
    holds after fine-tuning: `memory_cell.memory` [m, d] and `memory_cell.model.<base key>`
    for every base weight (perturbed here, so an import that kept the original base fails)."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    g = torch.Generator().manual_seed(seed)
    state = {"memory_cell.memory": torch.randn(M, base.config.hidden_size, generator=g)}
    with torch.no_grad():   # per parameter: tied weights (GPT-2's head) stay one tensor
        for p in base.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    for key, value in base.state_dict().items():
        state["memory_cell.model." + key] = value.clone()
    torch.save(state, path)
    return state


def _reference_from_state(base_dir, state, segments):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    base.load_state_dict({k[len("memory_cell.model."):]: v for k, v in state.items()
                          if k.startswith("memory_cell.model.")})
    with torch.no_grad():
        return authors_reference(base.eval(), state["memory_cell.memory"], segments)


def _run(model, segments):
    state, out = None, []
    with torch.no_grad():
        for seg in segments:
            res = model(seg, state, return_log_probs=True)
            state = res.state
            out.append((res.log_probs, state.tokens))
    return out


def _close(ours, ref):
    for (lp, mem), (ref_lp, ref_mem) in zip(ours, ref, strict=True):
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(mem, ref_mem, atol=1e-5, rtol=0)


def _exports_back_unchanged(tmp_path, state):
    """`memtrain export --format authors` of the import gives back the state dict it read."""
    assert main_export(["--model", str(tmp_path / "imp" / "model.safetensors"), "--format",
                        "authors", "--out", str(tmp_path / "back.pt")]) == 0
    back = read_state_dict(tmp_path / "back.pt")
    assert set(back) == set(state)
    for key in state:
        torch.testing.assert_close(back[key], state[key], atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_authors_checkpoint_imports_to_a_model_that_reproduces_their_loop(
        ckpt, arch, tmp_path, capsys):
    state = authors_checkpoint(ckpt[arch], tmp_path / "rmt.pt")
    assert main_import(["--state-dict", str(tmp_path / "rmt.pt"), "--base", str(ckpt[arch]),
                        "--segment-size", str(L), "--out", str(tmp_path / "imp")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_mem_tokens"] == M and summary["segment_size"] == L
    model = load_model(tmp_path / "imp" / "model.safetensors").eval()
    cfg = read_config(tmp_path / "imp" / "model.safetensors")
    assert (cfg.rmt.pattern, cfg.tgt_len, cfg.rmt.num_mem_tokens) == ("causal", L, M)
    segs = _segments()
    _close(_run(model, segs), _reference_from_state(ckpt[arch], state, segs))

    # ... and exports back to the same state dict (the authors' code loads it unchanged).
    _exports_back_unchanged(tmp_path, state)


def test_a_bare_memory_cell_state_dict_imports_too(ckpt, tmp_path):
    state = authors_checkpoint(ckpt["gpt2"], tmp_path / "rmt.pt")
    cell = {k[len("memory_cell."):]: v for k, v in state.items()}
    torch.save(cell, tmp_path / "cell.pt")
    assert main_import(["--state-dict", str(tmp_path / "cell.pt"), "--base",
                        str(ckpt["gpt2"]), "--segment-size", str(L), "--out",
                        str(tmp_path / "imp")]) == 0
    segs = _segments()
    model = load_model(tmp_path / "imp" / "model.safetensors").eval()
    _close(_run(model, segs), _reference_from_state(ckpt["gpt2"], state, segs))


def test_a_checkpoint_outside_the_layout_is_refused_by_name(ckpt, tmp_path, capsys):
    state = authors_checkpoint(ckpt["gpt2"], tmp_path / "rmt.pt")
    cases = {"no-memory": {k: v for k, v in state.items() if k != "memory_cell.memory"},
             "extra-key": {**state, "memory_cell.other.weight": torch.zeros(2)},
             "wrong-base": state}
    expect = {"no-memory": "no 'memory_cell.memory'", "extra-key": "outside the authors",
              "wrong-base": "does not fit the base model"}
    for name, bad in cases.items():
        torch.save(bad, tmp_path / f"{name}.pt")
        base = ckpt["llama"] if name == "wrong-base" else ckpt["gpt2"]
        assert main_import(["--state-dict", str(tmp_path / f"{name}.pt"), "--base", str(base),
                            "--segment-size", str(L), "--out", str(tmp_path / name)]) != 0
        assert expect[name] in capsys.readouterr().err


def _lora_model(path, pattern="causal"):
    torch.manual_seed(0)
    section = hf_model_section(path, M, L, finetune="lora")
    section["rmt"]["pattern"] = pattern
    model = build_model(ModelConfig.from_dict(section))
    with torch.no_grad():   # trained adapters: B != 0, or the adapter would be a no-op
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_peft_adapter_export_reproduces_memtrains_log_probs(ckpt, arch, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model = _lora_model(ckpt[arch])
    save_model(model, tmp_path / "run.safetensors")
    export_peft(load_model(tmp_path / "run.safetensors"), tmp_path / "adapter")
    meta = json.loads((tmp_path / "adapter" / MEMORY_CONFIG).read_text())
    assert (meta["mechanism"], meta["pattern"], meta["num_mem_tokens"],
            meta["segment_length"]) == ("rmt", "causal", M, L)
    base = AutoModelForCausalLM.from_pretrained(str(ckpt[arch]))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    memory = load_file(str(tmp_path / "adapter" / MEMORY_FILE))["memory_init.value"]
    segs = _segments()
    with torch.no_grad():
        ref = authors_reference(peft_model, memory, segs)
    _close(_run(model, segs), ref)


def test_a_lora_run_exports_to_the_authors_layout_with_the_adapters_merged(ckpt, tmp_path):
    model = _lora_model(ckpt["llama"])
    save_model(model, tmp_path / "run.safetensors")
    assert main_export(["--model", str(tmp_path / "run.safetensors"), "--format", "authors",
                        "--out", str(tmp_path / "rmt.safetensors")]) == 0
    state = read_state_dict(tmp_path / "rmt.safetensors")
    assert not any("lora_" in k or "base_layer" in k for k in state)
    segs = _segments()
    _close(_run(model, segs), _reference_from_state(ckpt["llama"], state, segs))


def test_exports_that_would_not_reproduce_are_refused(ckpt, tmp_path, capsys):
    save_model(_lora_model(ckpt["gpt2"], pattern="paper"), tmp_path / "paper.safetensors")
    assert main_export(["--model", str(tmp_path / "paper.safetensors"), "--format", "authors",
                        "--out", str(tmp_path / "x.pt")]) != 0
    assert "model.rmt.pattern" in capsys.readouterr().err
    torch.manual_seed(0)
    frozen = build_model(ModelConfig.from_dict(hf_model_section(ckpt["gpt2"], M, L,
                                                                finetune="frozen")))
    save_model(frozen, tmp_path / "frozen.safetensors")
    assert main_export(["--model", str(tmp_path / "frozen.safetensors"), "--format", "peft",
                        "--out", str(tmp_path / "adapter")]) != 0
    assert "model.hf.finetune" in capsys.readouterr().err


def test_init_from_loads_the_imported_memory_and_keeps_new_adapters(ckpt, tmp_path):
    authors_checkpoint(ckpt["gpt2"], tmp_path / "rmt.pt")
    assert main_import(["--state-dict", str(tmp_path / "rmt.pt"), "--base", str(ckpt["gpt2"]),
                        "--segment-size", str(L), "--out", str(tmp_path / "imp")]) == 0
    file = tmp_path / "imp" / "model.safetensors"
    imported = load_model(file)
    section = hf_model_section(tmp_path / "imp" / "base", M, L, finetune="lora")
    section["rmt"]["pattern"] = "causal"
    torch.manual_seed(1)
    model = build_model(ModelConfig.from_dict(section))
    lora_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    assert load_initial(model, file) == ["memory_init.value"]
    assert torch.equal(model.memory_init.value, imported.memory_init.value)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, lora_before[n])
    section["rmt"]["pattern"] = "paper"
    with pytest.raises(ValueError, match="model.rmt.pattern"):
        load_initial(build_model(ModelConfig.from_dict(section)), file)


# ---------------------------------------------------------------------------------- ARMT
D_MEM = 4


def armt_authors_checkpoint(base_dir, layers_path, path, wrap_pos, seed=0):
    """What `torch.save(AssociativeRecurrentWrapper(AssociativeMemoryCell(base, m, d_mem,
    layers_attr, wrap_pos)).state_dict())` holds, from the stated layout: every decoder
    layer's keys under `.layer.`, its W_mq/W_mk [d_mem, d], W_mv [d, d], W_mb [1, d] + [1]
    beside it, all of them again under the cell's `layers.` alias, `memory` [m, d]; with
    wrap_pos GPT-2's wpe grows by m rows."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    d, g = base.config.hidden_size, torch.Generator().manual_seed(seed)
    state = {"memory_cell.memory": torch.randn(M, d, generator=g)}
    n_layers = base.config.num_hidden_layers
    for key, value in base.state_dict().items():
        if key.startswith(layers_path + "."):
            i, rest = key[len(layers_path) + 1:].split(".", 1)
            key = f"{layers_path}.{i}.layer.{rest}"
        if wrap_pos and key.endswith("wpe.weight"):
            value = torch.cat([value, torch.randn(M, d, generator=g)])
        state["memory_cell.model." + key] = value.clone()
    for i in range(n_layers):
        pre = f"memory_cell.model.{layers_path}.{i}."
        for name, shape in (("W_mq.weight", (D_MEM, d)), ("W_mk.weight", (D_MEM, d)),
                            ("W_mv.weight", (d, d)), ("W_mb.weight", (1, d)),
                            ("W_mb.bias", (1,))):
            state[pre + name] = 0.3 * torch.randn(shape, generator=g)
    inside = f"memory_cell.model.{layers_path}."   # the cell's `layers` alias of them
    for key in [k for k in state if k.startswith(inside)]:
        state["memory_cell.layers." + key[len(inside):]] = state[key]
    torch.save(state, path)
    return state


@pytest.mark.parametrize("arch,layers_path,wrap_pos", [("gpt2", "transformer.h", True),
                                                       ("gpt2", "transformer.h", False),
                                                       ("llama", "model.layers", False)])
def test_an_armt_authors_checkpoint_imports_by_the_stated_map_and_exports_back_unchanged(
        ckpt, arch, layers_path, wrap_pos, tmp_path, capsys):
    state = armt_authors_checkpoint(ckpt[arch], layers_path, tmp_path / "armt.pt", wrap_pos)
    assert main_import(["--format", "armt-authors", "--state-dict", str(tmp_path / "armt.pt"),
                        "--base", str(ckpt[arch]), "--segment-size", str(L), "--out",
                        str(tmp_path / "imp")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    placement = "table_end" if wrap_pos else "follow"
    assert (summary["mechanism"], summary["d_key"], summary["memory_positions"]) == (
        "armt", D_MEM, placement)
    model = load_model(tmp_path / "imp" / "model.safetensors")
    cfg = model.cfg
    assert (cfg.armt.d_key, cfg.armt.nu, cfg.armt.feature_map, cfg.armt.gate,
            cfg.armt.carry_tokens, cfg.armt.memory_positions, cfg.armt.authors_gamma) == (
        D_MEM, 3, "dpfp", True, False, placement, True)
    pre = f"memory_cell.model.{layers_path}.1."
    blk = model.associative[1]
    for ours, theirs in ((blk.q_proj.weight, "W_mq.weight"), (blk.k_proj.weight,
                         "W_mk.weight"), (blk.v_proj.weight, "W_mv.weight"),
                         (blk.gate.weight, "W_mb.weight"), (blk.gate.bias, "W_mb.bias")):
        assert torch.equal(ours, state[pre + theirs])
    if wrap_pos:   # the memory reads the appended rows of the widened table
        table = model.base.base_model.wpe.weight
        assert table.shape[0] == model.base.config.n_positions == 64 + M
        assert torch.equal(table[-M:], state["memory_cell.model.transformer.wpe.weight"][-M:])
    _exports_back_unchanged(tmp_path, state)


def test_armt_memory_positions_follow_the_segment_or_sit_at_the_tables_end():
    from model.pretrained.positions import armt_position_ids
    assert armt_position_ids(2, 3, 8).tolist() == [[0, 1, 2, 8, 9]]
    assert armt_position_ids(2, 3, 8, placement="follow").tolist() == [[0, 1, 2, 3, 4]]
    assert armt_position_ids(2, 3, 8, placement="table_end", table=66).tolist() == [
        [0, 1, 2, 64, 65]]


def test_armt_memory_positions_are_refused_where_they_cannot_hold(ckpt):
    from model import ConfigError, resolve_shape
    section = hf_model_section(ckpt["llama"], M, L)
    section.update(mechanism="armt", armt={"memory_positions": "table_end"})
    with pytest.raises(ConfigError, match="rotary"):
        resolve_shape(ModelConfig.from_dict(section))
    with pytest.raises(ConfigError, match="model.armt.memory_positions"):
        ModelConfig(mechanism="armt", rmt={"num_mem_tokens": 2},
                    armt={"memory_positions": "follow"})


def test_an_import_becomes_a_run_with_max_steps_0_then_fine_tunes_from_it(
        ckpt, tmp_path, monkeypatch):
    """`init_from` + max_steps 0: the imported weights checkpointed, scored and exported as
    a run (what `memtrain eval`, `generate` and `export` read); then LoRA fine-tuning starts
    from the imported memory."""
    from train_helpers import train_in_process

    from data_pipeline.prepare import main_tasks
    from model import ConfigError
    from train.config import load_config
    authors_checkpoint(ckpt["gpt2"], tmp_path / "rmt.pt")
    assert main_import(["--state-dict", str(tmp_path / "rmt.pt"), "--base", str(ckpt["gpt2"]),
                        "--segment-size", "3", "--out", str(tmp_path / "imp")]) == 0
    assert main_tasks(["copy", "--src-len", "3", "--n-segments", "3", "--train-size", "64",
                       "--valid-size", "8", "--test-size", "8", "--out",
                       str(tmp_path / "data")]) == 0
    imported = load_model(tmp_path / "imp" / "model.safetensors")
    common = [f"model.hf.path={tmp_path / 'imp' / 'base'}", "model.rmt.pattern=causal",
              f"init_from={tmp_path / 'imp' / 'model.safetensors'}",
              f"data.path={tmp_path / 'data'}", "tracking.enabled=false", "data.global_batch=4",
              "eval.every=0", "log_every=1"]
    for name, extra in (("as-run", ["max_steps=0"]),
                        ("lora", ["max_steps=2", "model.hf.finetune=lora"])):
        cfg = load_config("copy-gpt2-hf-cpu", [*common, *extra, f"run_dir={tmp_path / name}"])
        train_in_process(cfg, monkeypatch)
    as_run = load_model(tmp_path / "as-run" / "model.safetensors")
    assert torch.equal(as_run.memory_init.value, imported.memory_init.value)
    tuned = load_model(tmp_path / "lora" / "model.safetensors")
    assert any("lora_" in n for n, _ in tuned.named_parameters())
    moved = (tuned.memory_init.value - imported.memory_init.value).abs().max()
    assert 0 < moved < 0.1   # two steps from the imported memory, not from a fresh draw
    with pytest.raises(ConfigError, match="max_steps"):
        load_config("copy-gpt2-hf-cpu", [f"data.path={tmp_path / 'data'}", "max_steps=0"])


def test_the_authors_gamma_is_one_on_the_first_write_then_has_eps_in_its_numerator():
    """model.armt.authors_gamma: gamma = 1 on a row's first write, then
    clip(1 - (phi(k)^T z + eps) / (|phi(k)|^2 + eps), 0, 1), as the authors' code does."""
    from model.mechanisms.armt.associative import EPS, AssociativeLayer, dpfp
    torch.manual_seed(0)
    layer = AssociativeLayer(8, 2, authors_gamma=True)
    plain = AssociativeLayer(8, 2)
    plain.load_state_dict(layer.state_dict())
    mem = [1e-3 * torch.randn(1, 3, 8), 1e-3 * torch.randn(1, 3, 8)]   # keys near eps
    A, z = layer.empty_state(1)
    A1, z1 = layer.write(A, z, mem[0])
    f0 = dpfp(layer.k_proj(mem[0]))
    torch.testing.assert_close(z1, f0.sum(1))                            # gamma = 1
    _, z2 = layer.write(A1, z1, mem[1])
    f1 = dpfp(layer.k_proj(mem[1]))
    den = (f1 * z1[:, None]).sum(-1)
    gamma = (1 - (den + EPS) / (f1.square().sum(-1) + EPS)).clamp(0, 1)
    torch.testing.assert_close(z2, z1 + (gamma[..., None] * f1).sum(1))
    _, z2_plain = plain.write(A1, z1, mem[1])
    # The two forms differ for such keys, relative to z itself.
    assert (z2 - z2_plain).abs().max() > 0.1 * z2.abs().max()
