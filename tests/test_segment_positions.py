"""A pretrained GPT-2 (a learned position table) read at a segment length other than the one
it was trained at: every tool that changes the segment length (lm-eval's `seg_len`,
`memtrain eval`'s `eval.tgt_len` and so `--babilong`, `memtrain generate --seg-len`) refuses,
by the option's name, a segment whose positions run past the table, instead of an
IndexError inside the base model; and a length that fits runs."""

from __future__ import annotations

import pytest
import torch
import yaml
from pretrained_helpers import hf_model_section, tiny_gpt2

from data_pipeline.shard_writer import write_manifest
from data_pipeline.shards import Manifest, id_dtype
from data_pipeline.vocab import SymbolVocab
from model import ConfigError, ModelConfig, build_model
from model.io import save_model

TABLE, M, SEG = 32, 3, 5          # 2 x 3 + 5 = 11 positions trained; 2 x 3 + 26 = 32 fit
VOCAB = SymbolVocab.build_chars("abcdefgh ?\n")


def write_char_manifest(folder) -> str:
    write_manifest(folder, Manifest(kind="tokens", source="chars", vocab=VOCAB.to_dict(),
                                    vocab_fingerprint=VOCAB.fingerprint(), vocab_size=VOCAB.size,
                                    dtype=str(id_dtype(VOCAB.size)), chunk_tokens=64, splits={}))
    return str(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(a GPT-2 with RMT memory exported as .safetensors, a data folder, the model's config)."""
    tmp = tmp_path_factory.mktemp("positions")
    ckpt = tiny_gpt2(tmp / "gpt2", vocab=64, n_positions=TABLE)
    section = {**hf_model_section(ckpt, m=M, tgt_len=SEG), "vocab_size": 64}
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(section)).eval()
    (tmp / "data").mkdir()
    return str(save_model(model, tmp / "hf.safetensors")), write_char_manifest(tmp / "data"), \
        section


def test_lm_eval_seg_len_past_the_position_table_is_refused_by_name(exported):
    from evaluation.lm_eval_model import MemtrainLM
    path, data, _ = exported
    with pytest.raises(ConfigError, match=r"^seg_len: 2 x num_mem_tokens \+ segment length = "
                                          r"35 positions .*beyond the model's learned table "
                                          r"of 32") as err:
        MemtrainLM(run_dir=path, data=data, device="cpu", seg_len=TABLE - 2 * M + 3)
    assert err.value.field == "seg_len"
    fits = MemtrainLM(run_dir=path, data=data, device="cpu", seg_len=TABLE - 2 * M)
    text = "abcdefgh " * 7                 # several segments of 26 tokens
    assert fits.loglikelihood_rolling([type("R", (), {"args": (text,)})()])[0] < 0


def test_generate_seg_len_past_the_position_table_is_refused_by_name(exported, capsys):
    from evaluation.generate_cli import main_generate
    path, data, _ = exported
    args = ["--checkpoint", path, "--data", data, "--prompt-ids", " ".join(["1", "2", "3"] * 10),
            "--max-new-tokens", "3", "--top-k", "1", "--ids"]
    assert main_generate([*args, "--seg-len", str(TABLE - 2 * M + 1)]) == 2
    assert "--seg-len: 2 x num_mem_tokens + segment length = 33" in capsys.readouterr().err
    assert main_generate([*args, "--seg-len", str(TABLE - 2 * M)]) == 0
    assert len(capsys.readouterr().out.split()) == 3


def test_babilong_eval_at_an_eval_tgt_len_past_the_position_table_is_refused_by_name(
        exported, tmp_path):
    from evaluation.babilong_report import run_babilong
    from train.config import load_config
    _, data, section = exported
    tree = {"name": "p", "run_dir": str(tmp_path / "run"), "model": section,
            "data": {"path": data, "global_batch": 2}, "tracking": {"enabled": False},
            "eval": {"tgt_len": TABLE}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    cfg = load_config(tmp_path / "run.yaml")
    with pytest.raises(ConfigError, match="beyond the model's learned table") as err:
        run_babilong(cfg, None, str(tmp_path / "babilong"), track=False)
    assert err.value.field == "eval.tgt_len"
