"""Evaluation tools on tiny checkpoints trained here: memory-length sweep, RECL, generation,
and the checks that stop a checkpoint from being loaded as another model.

The two runs learn the quickstart stream, where every block [A | filler | A] repeats 12
symbols exactly 16 tokens later: the dependency length is 16 by construction. One run has
a 16-token memory (segments of 16), the other none; neither can see 16 back within a segment.
"""

import json
import math
import subprocess

import pytest
import torch
from train_helpers import BIN, ROOT, child_env, run_train

from data_pipeline.vocab import ByteVocab, WordVocab
from evaluation import recl as R
from evaluation.generate_cli import StreamingDecoder

DEPENDENCY = 16


def _memtrain(*args, timeout=300):
    return subprocess.run([str(BIN / "memtrain"), *map(str, args)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaltools")
    dirs = {}
    for name, mem_len in (("mem16", 16), ("mem0", 0)):
        dirs[name] = tmp / name
        run_train(ROOT / "configs" / "quickstart.yaml",
                  [f"name={name}", "max_steps=400", f"model.mem_len={mem_len}",
                   f"run_dir={dirs[name]}", f"data.path={tmp / 'data'}", "eval.every=0",
                   "save_every=400", "eval.no_memory_baseline=false", "eval.max_segments=20",
                   # The tools log into the MLflow run of the run they read (mem16's).
                   f"tracking.enabled={str(mem_len > 0).lower()}"],
                  launcher="single")
    return dirs


def _mlflow_run(run_dir):
    from mlflow import MlflowClient
    state = json.loads((run_dir / "tracking.json").read_text())
    return MlflowClient(state["tracking_uri"]), state["run_id"]


# ----------------------------------------------------------------------------- RECL
def _naive_recl(losses, contexts, ratio, threshold):
    """Transformer-XL Appendix C written out with Python loops over models and tokens."""
    n_models, n_tok = losses[contexts[0]].shape
    out = []
    for i in range(n_models):
        result = (contexts[-1], False)
        for c, c2 in zip(contexts, contexts[1:], strict=False):
            b = [min(float(losses[c][j, t]) for j in range(n_models)) for t in range(n_tok)]
            k = max(1, round(ratio * n_tok))
            top = sorted(range(n_tok), key=lambda t: -b[t])[:k]
            f_cc = sum(b[t] for t in top) / k
            f_cc2 = sum(min(b[t], float(losses[c2][i, t])) for t in top) / k
            if (math.exp(f_cc) - math.exp(f_cc2)) / math.exp(f_cc) < threshold:
                result = (c, True)
                break
        out.append(result)
    return out


@pytest.mark.parametrize("ratio", [0.1, 0.5, 1.0])
def test_recl_statistic_equals_a_naive_loop_over_the_appendix_c_equations(ratio):
    g = torch.Generator().manual_seed(3)
    contexts = [4, 8, 12, 16, 20]
    # Three models whose losses fall with context at different rates, plus noise.
    losses = {c: torch.stack([2.0 + torch.rand(60, generator=g) * (3.0 / (1 + c * s))
                              for s in (0.05, 0.2, 1.0)]) for c in contexts}
    assert R.recl(losses, contexts, ratio, 0.01) == _naive_recl(losses, contexts, ratio, 0.01)


def test_a_model_still_gaining_at_the_largest_context_gets_a_lower_bound():
    contexts = [1, 2, 3]
    losses = {c: torch.full((1, 5), 5.0 - c) for c in contexts}  # always 1 nat better
    assert R.recl(losses, contexts, 1.0) == [(3, False)]
    res = R.compute(losses, ["m"], contexts, [1.0], 0.01)
    assert ">=3" in res.table()


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["rmt", "armt"])
def test_recl_losses_of_memory_token_models_are_read_at_each_context(tmp_path, mechanism):
    # RMT and ARMT define no same_length (their memory rows see their blocks whole): the
    # context c is imposed as mem_len alone, the losses those of a plain read at mem_len c.
    import numpy as np
    from reference import tiny_model

    from data_pipeline.shard_writer import write_manifest, write_token_split
    from data_pipeline.shards import Manifest, id_dtype, load_manifest
    from data_pipeline.streams import TokenStream
    model = tiny_model(mechanism)
    vocab = model.cfg.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, 400)
    info = write_token_split(tmp_path, "train", [ids], id_dtype(vocab), 64, 3)
    write_manifest(tmp_path, Manifest(kind="tokens", source="test", vocab={"kind": "test"},
                                      vocab_fingerprint="f" * 64, vocab_size=vocab,
                                      dtype=str(id_dtype(vocab)), chunk_tokens=64,
                                      splits={"train": info}))
    manifest = load_manifest(tmp_path)
    for context in (0, 8):
        got = R.per_token_losses(model, manifest, "train", 2, 4, context, 8, 16,
                                 torch.device("cpu"))
        state, want = None, []
        stream = TokenStream(manifest, "train", 2, 4, 0, 1)
        with torch.no_grad(), model.using_lengths(mem_len=context):
            for _, seg in zip(range(4), stream, strict=False):
                out = model(seg.tokens[:, :-1], state, targets=seg.tokens[:, 1:])
                state = out.state
                want.append(out.nll)
        assert torch.equal(got, torch.cat(want, dim=1)[:, 8:16].reshape(-1))


def test_recl_of_the_group_finds_the_streams_dependency_length(runs, tmp_path):
    done = _memtrain("recl", "--run-dirs", runs["mem16"], runs["mem0"], "--start", 4,
                     "--step", 4, "--max-context", 32, "--out", tmp_path / "recl")
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "recl" / "recl.json").read_text())
    assert res["models"] == ["mem16", "mem0"]
    for ratio in ("0.1", "0.5", "1.0"):
        with_memory, without = res["recl"][ratio]
        assert with_memory["reached"] and abs(with_memory["recl"] - DEPENDENCY) <= 4
        assert without["recl"] < with_memory["recl"]
    assert (tmp_path / "recl" / "recl.png").stat().st_size > 0
    client, run_id = _mlflow_run(runs["mem16"])
    assert client.get_run(run_id).data.metrics["recl_r0.1"] == res["recl"]["0.1"][0]["recl"]
    assert "recl/recl.json" in [a.path for a in client.list_artifacts(run_id, "recl")]


# ----------------------------------------------------------------------------- sweep
@pytest.mark.slow
def test_memory_sweep_scores_the_same_tokens_at_every_length_and_logs_a_curve(runs):
    done = _memtrain("eval", "--run-dir", runs["mem16"], "eval.clamp_len=40", "--sweep",
                     "--multiples", "0,1,2")
    assert done.returncode == 0, done.stderr[-3000:]
    path = next((runs["mem16"] / "eval").glob("sweep_*.json"))
    sweep = json.loads(path.read_text())
    points = {p["protocol"]["mem_len"]: p for p in sweep["points"]}
    assert sorted(points) == [0, 16, 32]
    assert len({p["tokens"] for p in points.values()}) == 1  # like with like
    assert sweep["skip_tokens"] >= 32
    # The repeat lies 16 back: no memory cannot predict it, a 16-token memory can.
    assert points[0]["loss"] > points[16]["loss"] + 0.3
    # Beyond clamp_len the point runs, and says why its positions are shared.
    assert points[16]["notes"] == [] and "clamp_len 40" in points[32]["notes"][0]
    assert "clamp_len 40" in done.stdout
    client, run_id = _mlflow_run(runs["mem16"])
    history = client.get_metric_history(run_id, "sweep_test_loss_tgt16")
    assert sorted((m.step, m.value) for m in history)[:3] == sorted(
        (m, p["loss"]) for m, p in points.items())
    arts = [a.path for a in client.list_artifacts(run_id, "eval")]
    assert path.with_suffix(".png").name in [a.split("/")[-1] for a in arts]


@pytest.mark.slow
def test_a_sweep_longer_than_the_data_can_fill_is_refused_with_the_reason(runs):
    done = _memtrain("eval", "--run-dir", runs["mem16"], "--sweep", "--mem-lens", "16,100000")
    assert done.returncode == 1
    assert "leave nothing to score after skipping" in done.stderr


# ----------------------------------------------------------------------------- mismatch
@pytest.mark.slow
def test_a_checkpoint_loaded_as_another_model_fails_naming_the_field(runs):
    done = _memtrain("eval", "--run-dir", runs["mem16"], "model.d_model=32", "--no-track")
    assert done.returncode == 1
    assert "model.d_model: the checkpoint" in done.stderr and "64" in done.stderr
    assert "Traceback" not in done.stderr
    # Evaluation lengths are not part of the weights: another mem_len loads fine.
    done = _memtrain("eval", "--run-dir", runs["mem16"], "model.mem_len=32", "--no-track")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpoint_written_with_a_field_this_code_does_not_know_is_named(runs, tmp_path):
    import shutil
    run = tmp_path / "copy"
    shutil.copytree(runs["mem16"], run)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(
        str(runs["mem16"]), str(run)))
    marker = next((run / "checkpoints").glob("step*/COMPLETE"))
    meta = json.loads(marker.read_text())
    meta["model"]["memory_gate"] = True
    marker.write_text(json.dumps(meta))
    done = _memtrain("eval", "--run-dir", run, "--no-track")
    assert done.returncode == 1 and "model.memory_gate" in done.stderr
    assert "does not accept" in done.stderr and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- generate
@pytest.mark.slow
def test_generate_streams_what_the_library_samples_with_the_memory_carried(runs):
    from evaluation.generation import load_for_generation
    from model import generate

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0, 0, 1, 2, 3]
    done = _memtrain("generate", "--checkpoint", runs["mem16"], "--prompt-ids",
                     " ".join(map(str, prompt)), "--max-new-tokens", 40, "--seed", 5,
                     "--top-k", 4)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [int(x) for x in done.stdout.split()]
    model, _ = load_for_generation(runs["mem16"], None)
    model.eval()
    expected = generate(model, torch.tensor([prompt]), 40, top_k=4,
                        generator=torch.Generator().manual_seed(5))[0, len(prompt):]
    assert printed == expected.tolist()  # 40 tokens: more than two segments of 16


def test_generate_rejects_a_text_prompt_without_a_text_vocabulary(runs):
    done = _memtrain("generate", "--checkpoint", runs["mem16"], "--prompt", "hello")
    assert done.returncode == 2 and "--prompt-ids" in done.stderr


def test_streaming_decoder_prints_multibyte_characters_and_words_whole():
    text = "naïve café — 記憶"
    byte_ids = list(ByteVocab().encode(text))
    dec = StreamingDecoder(ByteVocab(), as_ids=False)
    assert "".join(dec.push(int(i)) for i in byte_ids) + dec.flush() == text
    words = WordVocab(["<eos>", "the", "memory", "carries"])
    ids = [words.encode_lines(["the memory carries"])[i] for i in range(3)]
    dec = StreamingDecoder(words, as_ids=False)
    streamed = "".join(dec.push(int(i)) for i in ids)
    assert streamed.strip() == words.decode(ids).strip()
