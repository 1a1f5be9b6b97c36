"""`memtrain eval --babilong`: accuracy per bAbI task and length, scored the way BABILong
scores (evaluation/babilong.py, evaluation/babilong_report.py, compare's BABILong table).

The data are small folders in the on-disk format `memtrain tasks babilong` writes (one
episodic manifest per length with extra["babilong"], a <split>.samples.jsonl per split),
built here with a word vocabulary whose end-of-line token is the stop: rows are
[filler][facts][question][answer][stop ...], right-aligned, the answer field the last A ids.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from compare_helpers import REAL_EXP, _compare, _experiment, synthetic_run
from reference import sharpened_model
from train_helpers import train_in_process

from data_pipeline.babilong.cli import main_babilong
from data_pipeline.shard_writer import write_episode_split, write_manifest
from data_pipeline.shards import Manifest, id_dtype
from data_pipeline.vocab import WordVocab
from data_pipeline.vocab_by_kind import vocab_from_dict
from evaluation import babilong as B
from evaluation.babilong_score import is_correct
from evaluation.cli import main_eval
from model import LMOutput
from model.memory import XLMemory
from train.config import load_config

ROOMS = ["kitchen", "garden", "hallway", "office", "bathroom", "bedroom"]
PEOPLE = ["mary", "john", "sandra", "daniel"]
WORDS = ["<eos>", ".", "where", "is", "?", "moved", "to", "the", "went", "answer", ":",
         *ROOMS, *PEOPLE]
VOCAB = WordVocab(WORDS)
STOP = VOCAB.eos_id
A = 2                       # answer field: one word + its stop
SEG = 8
# folder label -> T (the sample length in tokens); 0k is the story alone, padded in front.
LENGTHS = {"0k": 24, "1k": 48, "2k": 96}
TASKS = ("qa1", "qa2")


def _story(rng, task):
    """(facts, question, target) of a bAbI-like story: who moved where, asked about one."""
    people = list(rng.choice(PEOPLE, size=2, replace=False))
    rooms = list(rng.choice(ROOMS, size=2, replace=False))
    facts = [f"{p} moved to the {r} ." for p, r in zip(people, rooms, strict=True)]
    k = 0 if task == "qa1" else 1
    return facts, f"where is {people[k]} ?", rooms[k]


def write_babilong(root, n_per_task=6, seed=0, lengths=LENGTHS, splits=("train", "valid",
                                                                          "test")):
    """DIR/<label>/{manifest.json, shards, <split>.samples.jsonl} for every length."""
    rng = np.random.default_rng(seed)
    dtype = id_dtype(len(VOCAB))
    for label, T in lengths.items():
        out = root / label
        out.mkdir(parents=True)
        infos = {}
        for split in splits:
            rows, recs = [], []
            for i in range(n_per_task * len(TASKS)):
                task = TASKS[i % len(TASKS)]
                facts, question, target = _story(rng, task)
                prompt = VOCAB.encode(" ".join(facts) + " " + question + " answer :")[:-1]
                ids = [*prompt.tolist(), VOCAB.index[target], *[STOP] * (A - 1)]
                row = np.full(T + 1, VOCAB.index["."], dtype=np.int64)
                row[T + 1 - len(ids):] = ids
                rows.append(row)
                recs.append({"task": task, "question": question, "target": target,
                             "length": T, "facts": facts})
            tokens = np.stack(rows).astype(dtype)
            mask = np.zeros((len(rows), T), dtype=bool)
            mask[:, T - A:] = True
            infos[split] = write_episode_split(out, split, tokens, mask, mask.copy(), 5)
            (out / f"{split}.samples.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in recs))
        extra = {"n_segments": T // SEG, "babilong": {
            "tasks": list(TASKS), "length": T, "seg_len": SEG, "answer_tokens": A,
            "labels": {t: ROOMS for t in TASKS}, "source": "generated"}}
        write_manifest(out, Manifest(kind="episodes", source="babilong", vocab=VOCAB.to_dict(),
                                     vocab_fingerprint=VOCAB.fingerprint(),
                                     vocab_size=len(VOCAB), dtype=str(dtype), chunk_tokens=T + 1,
                                     splits=infos, extra=extra))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_babilong(tmp_path_factory.mktemp("babilong") / "data")


# ---------------------------------------------------------------------------- stub models
class Oracle(torch.nn.Module):
    """A model of the segment protocol whose memory is every id it was fed (an XL cache of
    unbounded length) and whose log-probability sits on the ids `answers` gives for the row
    it recognises by its whole prompt, then on the stop. A lost memory means an unknown
    prompt, for which it predicts the stop at once: an empty, wrong answer."""

    def __init__(self, answers: dict[tuple, list[int]], prompt_len: int, stop: int,
                 vocab_size: int):
        super().__init__()
        self.cfg = SimpleNamespace(tgt_len=SEG, vocab_size=vocab_size, backbone="native")
        self.answers, self.prompt_len, self.stop = answers, prompt_len, stop

    def initial_state(self, batch_size, device=None):
        return XLMemory(hids=[torch.zeros(batch_size, 0, 1)],
                        length=torch.zeros(batch_size, dtype=torch.long))

    def forward(self, tokens, state=None, return_log_probs=False, **_):
        seen = torch.cat([state.hids[0][..., 0].long(), tokens], dim=1)
        log_probs = torch.full((*tokens.shape, self.cfg.vocab_size), -30.0)
        for b, row in enumerate(seen.tolist()):
            ids = self.answers.get(tuple(row[:self.prompt_len]), [])
            at = len(row) - self.prompt_len
            log_probs[b, -1, ids[at] if 0 <= at < len(ids) else self.stop] = 0.0
        new = XLMemory(hids=[seen[..., None].float()], length=state.length + tokens.shape[1])
        return LMOutput(state=new, log_probs=log_probs if return_log_probs else None)


def _oracle(folder, wrong=False):
    """The row's own answer field, or with `wrong` another label of the task that the
    question does not name (BABILong ignores a label the question names)."""
    vocab = vocab_from_dict(folder.manifest.vocab)
    stop = int(vocab.encode(B.stop_text(folder))[-1])
    answers = {}
    for toks, recs in B.iter_batches(folder, "test", 100, folder.tasks):
        for row, rec in zip(toks, recs, strict=True):
            ids = row[-folder.answer_tokens:].tolist()
            if wrong:
                other = next(x for x in folder.labels[rec["task"]]
                             if x != rec["target"] and x not in rec["question"].lower())
                ids = vocab.encode(" " + other).tolist()
            answers[tuple(row[:-folder.answer_tokens].tolist())] = ids
    return Oracle(answers, folder.manifest.chunk_tokens - folder.answer_tokens, stop,
                  folder.manifest.vocab_size)


@pytest.mark.parametrize("wrong", [False, True])
def test_a_model_that_names_the_target_scores_one_and_one_naming_another_room_zero(data,
                                                                                    wrong):
    folders, tasks = B.find_folders(data, "test")
    for folder in folders:
        cells, _ = B.score_folder(_oracle(folder, wrong), folder, "test", tasks, seg_len=SEG,
                                  batch=4, device=torch.device("cpu"))
        assert sorted(cells) == list(TASKS)
        for cell in cells.values():
            assert cell.n == 6
            assert cell.accuracy == (0.0 if wrong else 1.0)
            assert cell.chance == pytest.approx(1 / len(ROOMS))
            # The real rule scored the decoded text, cut at the stop.
            ex = cell.examples[0]
            assert ex["output"].strip() in ROOMS
            assert is_correct(ex["output"], ex["target"], ex["question"], ROOMS) is not wrong


@pytest.mark.parametrize("wrong", [False, True])
def test_the_data_memtrain_tasks_babilong_writes_are_scored_by_the_same_rule(tmp_path, wrong):
    rng = np.random.default_rng(0)
    words = ["the", "a", "cat", "sat", "on", "mat", "river", "ran", "fast", "slow", "house"]
    (tmp_path / "bg.txt").write_text("\n".join(
        " ".join(rng.choice(words, rng.integers(5, 12))).capitalize() + "."
        for _ in range(2000)))
    out = tmp_path / "data"
    assert main_babilong(["--out", str(out), "--tasks", "qa1,qa2", "--lengths", "0,1k",
                          "--seg-len", "128", "--background", str(tmp_path / "bg.txt"),
                          "--train-size", "1", "--valid-size", "1", "--test-size", "3",
                          "--max-facts", "4"]) == 0
    folders, tasks = B.find_folders(out, "test", lengths=["1k", "0k"])
    assert [f.length for f in folders] == [0, 1024] and tasks == ["qa1", "qa2"]
    for folder in folders:
        cells, _ = B.score_folder(_oracle(folder, wrong), folder, "test", tasks, seg_len=128,
                                  batch=4, device=torch.device("cpu"))
        assert {t: (c.n, c.accuracy) for t, c in cells.items()} == {
            t: (3, 0.0 if wrong else 1.0) for t in tasks}


def test_an_oracle_that_loses_its_memory_between_segments_scores_zero(data):
    folders, tasks = B.find_folders(data, "test", lengths=["1k"])
    oracle = _oracle(folders[0])
    forget = oracle.initial_state
    original = oracle.forward

    def amnesic(tokens, state=None, **kw):  # every segment starts from an empty memory
        return original(tokens, forget(tokens.shape[0]), **kw)

    oracle.forward = amnesic
    cells, _ = B.score_folder(oracle, folders[0], "test", tasks, seg_len=SEG, batch=4,
                              device=torch.device("cpu"))
    assert all(c.accuracy == 0.0 for c in cells.values())


# ---------------------------------------------------------------------------- real models
def _naive_greedy(model, prompt, n_new, seg):
    """Every new id from re-reading the whole sequence so far from a fresh memory, segment
    by segment, one row at a time: no state kept between steps."""
    out = []
    for row in prompt:
        seq = row.tolist()
        for _ in range(n_new):
            state = model.initial_state(1)
            for s in range(0, len(seq), seg):
                res = model(torch.tensor([seq[s:s + seg]]), state, return_log_probs=True)
                state = res.state
            seq.append(int(res.log_probs[0, -1].argmax()))
        out.append(seq[len(row):])
    return out


@pytest.mark.parametrize("mechanism,mem_len", [("rmt", 0), ("xl", 6)])
def test_answers_generated_with_the_memory_carried_equal_a_naive_rereading(data, mechanism,
                                                                           mem_len):
    model = sharpened_model(mechanism, mem_len, vocab=len(VOCAB), seg=SEG, seed=3)
    folders, tasks = B.find_folders(data, "test", lengths=["2k"])
    folder = folders[0]
    seen = []

    def record(output, target, question, labels):
        seen.append(output)
        return is_correct(output, target, question, labels)

    B.score_folder(model, folder, "test", tasks, seg_len=SEG, batch=5,
                   device=torch.device("cpu"), score=record)
    rows = np.concatenate([t for t, _ in B.iter_batches(folder, "test", 100, list(TASKS))])
    naive = _naive_greedy(model, torch.from_numpy(rows[:, :-A]), A, SEG)
    # Rows come out per task in order of reading, the same order as iter_batches.
    assert seen == [B.decode_answer(VOCAB, ids) for ids in naive]
    # Batched generation must give the same ids as the one-row loop (not only the same text).
    got = B.generate_answers(model, torch.from_numpy(rows[:, :-A]), A, SEG)
    assert got.tolist() == naive


def test_samples_and_tasks_limit_the_rows_read_and_lengths_are_sorted(data):
    folders, tasks = B.find_folders(data, "test", tasks=["qa2"], lengths=["2k", "0k"])
    assert [f.label for f in folders] == ["0k", "2k"] and tasks == ["qa2"]
    batches = list(B.iter_batches(folders[1], "test", 2, tasks, samples=3))
    assert [len(r) for _, r in batches] == [2, 1]
    assert all(rec["task"] == "qa2" for _, recs in batches for rec in recs)
    assert batches[0][0].shape == (2, LENGTHS["2k"] + 1)


# ---------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_naming_what_is_wrong(data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no length folders"):
        B.find_folders(empty, "test")
    with pytest.raises(ValueError, match=r"--tasks qa9: not in the data .* qa1, qa2"):
        B.find_folders(data, "test", tasks=["qa1", "qa9"])
    with pytest.raises(ValueError, match=r"--lengths 8k: not in .*0k, 1k, 2k"):
        B.find_folders(data, "test", lengths=["8k"])
    other = write_babilong(tmp_path / "nosamples", n_per_task=1, lengths={"0k": 24})
    (other / "0k" / "test.samples.jsonl").unlink()
    with pytest.raises(ValueError, match="no test.samples.jsonl"):
        B.find_folders(other, "test")
    # A folder of another format: a token stream's manifest, and one with no manifest.
    stream = tmp_path / "mixed"
    write_babilong(stream, n_per_task=1, lengths={"0k": 24})
    manifest = json.loads((stream / "0k" / "manifest.json").read_text())
    manifest.update(kind="tokens", extra={})
    (stream / "0k" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"0k is not a BABILong length folder"):
        B.find_folders(stream, "test")
    (stream / "notes").mkdir()
    with pytest.raises(ValueError, match="notes holds no manifest.json"):
        B.find_folders(stream, "test")


# ---------------------------------------------------------------------------- the command
def test_eval_writes_json_md_png_and_logs_one_metric_per_task_against_length(
        data, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    cfg = tmp_path / "babi.yaml"
    cfg.write_text(json.dumps({
        "name": "babi", "run_dir": str(run_dir), "max_steps": 2, "save_every": 2,
        "log_every": 1, "threads": 1,
        "model": {"mechanism": "rmt", "vocab_size": len(VOCAB), "n_layer": 1, "d_model": 16,
                  "n_head": 2, "d_inner": 32, "tgt_len": SEG, "mem_len": 0,
                  "rmt": {"num_mem_tokens": 2}},
        "data": {"path": str(data / "0k"), "global_batch": 4},
        "eval": {"every": 0}}))
    train_in_process(load_config(cfg), monkeypatch)
    capsys.readouterr()
    code = main_eval(["--run-dir", str(run_dir), "--babilong", str(data), "--tasks",
                      "qa1,qa2", "--samples", "4", "eval.split=test"])
    assert code == 0, capsys.readouterr().err[-3000:]
    out = run_dir / "eval"
    path = next(out.glob("babilong_*_test_*.json"))
    result = json.loads(path.read_text())
    assert [x["label"] for x in result["lengths"]] == list(LENGTHS)
    assert {(c["task"], c["length"]) for c in result["cells"]} == {
        (t, n) for t in TASKS for n in LENGTHS.values()}
    assert all(c["n"] == 4 and c["chance"] == pytest.approx(1 / 6) for c in result["cells"])
    md = path.with_suffix(".md").read_text()
    assert "| task | 0k (24) | 1k (48) | 2k (96) | chance |" in md
    qa1 = {c["length"]: c["accuracy"] for c in result["cells"] if c["task"] == "qa1"}
    assert "| qa1 | " + " | ".join(f"{qa1[n]:.3f} (4)" for n in LENGTHS.values()) in md
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    from mlflow import MlflowClient
    state = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(state["tracking_uri"])
    for task in TASKS:
        hist = client.get_metric_history(state["run_id"], f"babilong_test_{task}")
        cells = {c["length"]: c["accuracy"] for c in result["cells"] if c["task"] == task}
        assert {m.step: m.value for m in hist} == pytest.approx(cells)
    names = {a.path for a in client.list_artifacts(state["run_id"], "eval")}
    assert {f"eval/{path.stem}{s}" for s in (".json", ".md", ".png")} <= names
    # A task the data lack is named; the mode's options are refused without it.
    capsys.readouterr()
    assert main_eval(["--run-dir", str(run_dir), "--babilong", str(data), "--tasks",
                      "qa7"]) == 2
    assert "--tasks qa7" in capsys.readouterr().err
    assert main_eval(["--run-dir", str(run_dir), "--tasks", "qa1"]) == 2
    assert "need --babilong" in capsys.readouterr().err


def test_eval_substring_scores_labels_as_the_authors_code_does(data, tmp_path, monkeypatch,
                                                                capsys):
    # The command's wiring only: the checkpoint, the model and the scoring loop are stubs
    # that record the rule `memtrain eval --babilong` scores with.
    import contextlib

    import evaluation.babilong_report as report
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(json.dumps({
        "name": "babi", "run_dir": str(run_dir),
        "model": {"mechanism": "rmt", "vocab_size": len(VOCAB), "n_layer": 1, "d_model": 16,
                  "n_head": 2, "d_inner": 32, "tgt_len": SEG, "mem_len": 0,
                  "rmt": {"num_mem_tokens": 2}},
        "data": {"path": str(data / "0k"), "global_batch": 4}}))

    class Stub:
        def to(self, device):
            return self

        @contextlib.contextmanager
        def using_lengths(self, *args):
            yield

    used = []

    def evaluate(model, folders, split, tasks, *, score, **_):
        used.append(score)
        return {"split": split, "tasks": [], "seg_len": SEG, "lengths": [], "cells": []}
    monkeypatch.setattr(report, "pick_checkpoint",
                        lambda cfg, name: SimpleNamespace(path=run_dir / "step1", step=1,
                                                          tag="step1"))
    monkeypatch.setattr(report, "load_weights", lambda info, model_cfg: Stub())
    monkeypatch.setattr(report, "_fit_vocab", lambda model, manifest, path: model)
    monkeypatch.setattr(report, "evaluate_babilong", evaluate)
    monkeypatch.setattr(report, "save_and_log", lambda *a, **k: tmp_path / "out.json")
    base = ["--run-dir", str(run_dir), "--babilong", str(data), "--no-track"]
    assert main_eval([*base, "--substring"]) == 0
    assert "labels matched as substrings" in capsys.readouterr().out
    assert main_eval(base) == 0
    assert "labels matched as whole words" in capsys.readouterr().out
    question = "Where is Mary?"
    assert used[0]("the bedrooms", "bedroom", question, ROOMS)        # the authors' quirk
    assert not used[1]("the bedrooms", "bedroom", question, ROOMS)
    assert main_eval(["--run-dir", str(run_dir), "--substring"]) == 2
    assert "need --babilong" in capsys.readouterr().err


# ---------------------------------------------------------------------------- compare
def test_compare_shows_two_runs_babilong_tables_side_by_side(tmp_path, capsys):
    from mlflow import MlflowClient
    from mlflow.entities import Metric
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = _experiment(client, REAL_EXP, tmp_path / "artifacts")
    ids = [synthetic_run(client, exp, i) for i in range(2)]
    scores = {0: {"qa1": {0: 1.0, 1024: 0.5}, "qa2": {0: 0.75}},
              1: {"qa1": {0: 0.25, 1024: 0.125}, "qa2": {0: 0.0, 1024: 0.5}}}
    for i, run_id in enumerate(ids):
        client.log_batch(run_id, metrics=[Metric(f"babilong_test_{t}", v, 0, n)
                                          for t, pts in scores[i].items()
                                          for n, v in pts.items()])
    code, _, err = _compare(["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                             "--experiment", REAL_EXP, "--out", str(tmp_path / "cmp"),
                             "--no-log"], capsys)
    assert code == 0, err
    from compare_helpers import Page
    page = Page((tmp_path / "cmp" / "report.html").read_text())
    rows = {r["task"]: r for r in page.table("babilong")}
    assert rows["qa1"] == {"task": "qa1", "#1 0 tokens": "1.000", "#1 1024 tokens": "0.500",
                           "#2 0 tokens": "0.250", "#2 1024 tokens": "0.125"}
    assert rows["qa2"]["#1 1024 tokens"] == "" and rows["qa2"]["#2 1024 tokens"] == "0.500"
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| qa1 | 1.000 | 0.500 | 0.250 | 0.125 |" in md
