"""`memtrain tasks babilong`: the facts of bAbI stories hidden in background text at lengths
in the model's tokens, seeded, one episodic data set per length (or every length together
for a length curriculum), with the answer as the only scored positions."""

import json
import re

import numpy as np
import pytest

from data_pipeline.babilong.background import SentencePool
from data_pipeline.babilong.build import parse_length, read_samples
from data_pipeline.babilong.cli import main_babilong
from data_pipeline.shards import load_manifest, read_episodes
from data_pipeline.streams import EpisodeStream, LayoutError
from data_pipeline.vocab import ByteVocab
from data_pipeline.vocab_by_kind import vocab_from_dict


def _background(path, first: int, n: int):
    """Numbered sentences, so a row's background tells where in the text it came from."""
    path.write_text(" ".join(f"Sentence {i} says nothing at all." for i in range(first,
                                                                                first + n)))
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("bg")
    return {s: _background(d / f"{s}.txt", first, 400)
            for s, first in (("train", 0), ("valid", 1000), ("test", 2000))}


def _build(out, texts, *extra, lengths="0,256,512", tasks="qa1,qa2"):
    argv = ["--out", str(out), "--tasks", tasks, "--lengths", lengths, "--seg-len", "64",
            "--background", str(texts["train"]), "--background-valid", str(texts["valid"]),
            "--background-test", str(texts["test"]), "--max-facts", "5",
            "--train-size", "12", "--valid-size", "4", "--test-size", "6", *extra]
    assert main_babilong(argv) == 0
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory, texts):
    return _build(tmp_path_factory.mktemp("bl") / "d", texts)


def _rows(path, split="test"):
    m = load_manifest(str(path))
    tokens, loss, answer = read_episodes(m, split)
    return m, tokens, loss, answer, vocab_from_dict(m.vocab)


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_ones(tmp_path, texts, data):
    again = _build(tmp_path / "again", texts)
    for length in ("0k", "256", "512"):
        for f in sorted(p.name for p in (data / length).iterdir()):
            assert (data / length / f).read_bytes() == (again / length / f).read_bytes(), f
    other = _build(tmp_path / "other", texts, "--seed", "1")
    assert (other / "512" / "test-000000.tar").read_bytes() != \
        (data / "512" / "test-000000.tar").read_bytes()


def test_every_row_is_its_length_with_the_answer_as_the_only_scored_positions(data):
    for length, T in (("256", 256), ("512", 512)):
        m, tokens, loss, answer, vocab = _rows(data / length)
        A = m.extra["babilong"]["answer_tokens"]
        assert tokens.shape[1] == T + 1 and m.extra["n_segments"] == T // 64
        assert np.array_equal(loss, answer)
        for row, mask, s in zip(tokens, loss, read_samples(data / length, "test"), strict=True):
            text = vocab.decode(row)
            prompt = vocab.decode(row[:T + 1 - A])
            assert prompt.endswith(f"\nQuestion: {s['question']}\nAnswer:")
            # target position t predicts row[t + 1]: the scored ids are " label\n"
            assert vocab.decode(row[1:][mask]) == f" {s['target']}\n"
            assert not mask[:T - A].any()
            assert not text.startswith(" " * 2)   # background fills it: no filler in front


def test_the_facts_keep_their_order_between_whole_background_sentences(data):
    for length in ("256", "512"):
        *_, tokens, _, _, vocab = _rows(data / length)
        for row, s in zip(tokens, read_samples(data / length, "test"), strict=True):
            text = vocab.decode(row)
            at = -1
            for fact in s["facts"]:
                found = text.find(" " + fact, at + 1)
                assert found > at, (fact, text)
                assert text[found - 1] == "."      # after a whole sentence (or fact)
                at = found


def test_each_split_draws_its_background_from_its_own_text(data):
    def numbers(split):
        *_, tokens, _, _, vocab = _rows(data / "512", split)
        return {int(n) for row in tokens for n in re.findall(r"Sentence (\d+)",
                                                              vocab.decode(row))}
    train, valid, test = numbers("train"), numbers("valid"), numbers("test")
    assert train and valid and test
    assert max(train) < 1000 <= min(valid) <= max(valid) < 2000 <= min(test)


def test_every_length_asks_the_same_questions_about_the_same_stories(data):
    base = read_samples(data / "0k", "test")
    assert {s["task"] for s in base} == {"qa1", "qa2"} and len(base) == 12
    for length in ("256", "512"):
        other = read_samples(data / length, "test")
        keep = ("task", "question", "target", "facts")
        assert [[s[k] for k in keep] for s in other] == [[s[k] for k in keep] for s in base]


def test_length_0_is_the_story_alone_padded_in_front_to_whole_segments(data):
    m, tokens, loss, _, vocab = _rows(data / "0k")
    assert (tokens.shape[1] - 1) % 64 == 0
    for row, s in zip(tokens, read_samples(data / "0k", "test"), strict=True):
        text = vocab.decode(row).lstrip(" ")
        assert text == " ".join(s["facts"]) + f"\nQuestion: {s['question']}\nAnswer: " \
            f"{s['target']}\n" + "\n" * (m.extra["babilong"]["answer_tokens"]
                                         - len(f" {s['target']}\n"))


def test_rows_of_several_lengths_train_one_length_per_curriculum_stage(tmp_path, texts):
    out = _build(tmp_path / "together", texts, "--together", lengths="256,512")
    m = load_manifest(str(out))
    assert m.extra["n_segments"] == 8
    assert [r[0] for r in m.extra["babilong"]["length_rows"]["train"]] == [256, 512]
    vocab = vocab_from_dict(m.vocab)
    stream = EpisodeStream(m, "train", 4, seed=0, n_segments=4)
    assert stream.episodes_per_epoch == 24 // 4      # the 256-token rows of 2 tasks x 12
    for _, segs in zip(range(6), stream, strict=False):
        assert len(segs) == 4 and segs[0].tokens.shape[1] == 65
        assert bool(segs[0].reset.all()) and not bool(segs[1].reset.any())
        row = np.concatenate([s.tokens[0, :-1] for s in segs] + [segs[-1].tokens[0, -1:]])
        text = vocab.decode(row)
        # a whole 256-token sample, from its first token: no filler, its answer at the end
        assert len(row) == 257 and not text.startswith("  ") and text.endswith("\n")
    stream.set_segments(8)
    assert len(next(iter(stream))) == 8
    with pytest.raises(LayoutError, match=r"samples of \[4, 8\] segments, not 3"):
        stream.set_segments(3)


def test_a_sentence_pool_fills_exactly_the_tokens_asked_for():
    pool = SentencePool(["One two three. Four five six seven. Eight nine."], ByteVocab(), "t")
    rng = np.random.default_rng(0)
    for n in (1, 5, 13, 40, 500):
        pieces = pool.draw(rng, n)
        assert sum(p.size for p in pieces) == n
    assert pool.draw(rng, 0) == []


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "100"], r"whole segments of --seg-len 64.*100 -> 64 or 128"),
    (["--lengths", "64", "--max-facts", "5"], r"does not fit in 64 tokens"),
    (["--lengths", "0", "--tasks", "qa9"], r"choose from qa1, qa2, qa3, qa4, qa5"),
    (["--lengths", "1q"], r"write tokens as 512, 1k"),
    (["--lengths", "0", "--max-facts", "1", "--tasks", "qa2"], r"at least 2 facts"),
])
def test_bad_input_is_refused_with_a_message_naming_it(tmp_path, texts, capsys, argv,
                                                       message):
    base = ["--out", str(tmp_path / "o"), "--seg-len", "64", "--background",
            str(texts["train"]), "--train-size", "2", "--valid-size", "1", "--test-size", "1"]
    assert main_babilong(base + argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_lengths_above_0_need_background_text(tmp_path, capsys):
    assert main_babilong(["--out", str(tmp_path / "o"), "--lengths", "128",
                          "--seg-len", "64"]) == 2
    assert "need background text" in capsys.readouterr().err


def test_lengths_read_k_and_m_as_powers_of_two():
    assert [parse_length(x) for x in ("0", "512", "1k", "64K", "1M")] == \
        [0, 512, 1024, 65536, 1 << 20]


def test_the_published_files_become_a_test_set_of_the_same_format(tmp_path):
    root = tmp_path / "babilong" / "data" / "qa1"
    root.mkdir(parents=True)
    records = [{"input": "Mary went to the kitchen. Some noise here. John moved to the office.",
                "question": "Where is Mary?", "target": "kitchen"},
               {"input": "Noise. Daniel journeyed to the garden.",
                "question": "Where is Daniel?", "target": "garden"}]
    (root / "1k.json").write_text(json.dumps(records))
    assert main_babilong(["--official", str(tmp_path / "babilong"), "--tasks", "qa1",
                          "--lengths", "1k", "--seg-len", "32", "--out",
                          str(tmp_path / "o")]) == 0
    m, tokens, loss, _, vocab = _rows(tmp_path / "o" / "1k")
    assert set(m.splits) == {"test"} and m.extra["babilong"]["source"] == "official"
    samples = read_samples(tmp_path / "o" / "1k", "test")
    for row, mask, rec, s in zip(tokens, loss, records, samples, strict=True):
        assert rec["input"] in vocab.decode(row) and s["target"] == rec["target"]
        assert vocab.decode(row[1:][mask]) == f" {rec['target']}\n"


def _official(tmp_path, records_of: dict[str, list[dict]], length="1k"):
    for task, records in records_of.items():
        folder = tmp_path / "babilong" / "data" / task
        folder.mkdir(parents=True)
        (folder / f"{length}.json").write_text(json.dumps(records))
    assert main_babilong(["--official", str(tmp_path / "babilong"), "--tasks",
                          ",".join(records_of), "--lengths", length, "--seg-len", "32",
                          "--out", str(tmp_path / "o")]) == 0
    return tmp_path / "o" / length


def test_published_qa8_compound_answers_are_scored_against_the_official_labels(tmp_path):
    from data_pipeline.babilong.labels import TASK_LABELS
    from evaluation.babilong import find_folders
    from evaluation.babilong_score import is_correct

    question = "What is Daniel carrying?"
    records = [{"input": "Daniel got the apple. Noise. Daniel took the milk.",
                "question": question, "target": target}
               for target in ("apple,milk", "nothing", "milk")]
    where = _official(tmp_path, {"qa8": records})
    (folder,), _ = find_folders(where.parent, "test")
    assert is_correct("the apple and the milk", "apple,milk", question, folder.labels["qa8"])
    assert is_correct("apple,milk", "apple,milk", question, folder.labels["qa8"])
    assert not is_correct("the apple", "apple,milk", question, folder.labels["qa8"])
    assert folder.labels["qa8"] == list(TASK_LABELS["qa8"])
    # the compound answer is still written whole into its row
    m, tokens, loss, _, vocab = _rows(where)
    assert vocab.decode(tokens[0][1:][loss[0]]) == " apple,milk\n"


def test_every_published_task_has_its_official_label_set(tmp_path):
    from data_pipeline.babilong.labels import TASK_LABELS

    tasks = [f"qa{i}" for i in range(1, 21)]
    assert set(TASK_LABELS) == set(tasks) and all(TASK_LABELS.values())
    # one published sample per task, answered with one of the task's labels
    where = _official(tmp_path, {t: [{"input": "Noise.", "question": "Well?",
                                      "target": TASK_LABELS[t][-1]}] for t in tasks})
    labels = load_manifest(str(where)).extra["babilong"]["labels"]
    assert labels == {t: list(TASK_LABELS[t]) for t in tasks}


def test_a_published_target_outside_the_official_labels_is_refused(tmp_path, capsys):
    folder = tmp_path / "babilong" / "data" / "qa7"
    folder.mkdir(parents=True)
    (folder / "1k.json").write_text(json.dumps([{"input": "x", "question": "How many?",
                                                 "target": "kitchen"}]))
    assert main_babilong(["--official", str(tmp_path / "babilong"), "--tasks", "qa7",
                          "--lengths", "1k", "--seg-len", "32", "--out",
                          str(tmp_path / "o")]) == 2
    assert "qa7 at 1k: target 'kitchen' is not one of the task's labels" in \
        capsys.readouterr().err


def test_together_the_stories_alone_are_bucketed_by_the_segments_they_fill(tmp_path, texts):
    from data_pipeline.streams import length_buckets
    from train.config import CurriculumConfig
    from train.curriculum import SegmentCurriculum

    out = _build(tmp_path / "together", texts, "--together", lengths="0,256")
    m = load_manifest(str(out))
    tokens, _, _ = read_episodes(m, "train")
    records = read_samples(out, "train")
    buckets = length_buckets(m, "train")
    bucket_of = {int(i): k for k, rows in buckets.items() for i in rows}
    assert sorted(bucket_of) == list(range(len(records)))   # every row in one bucket
    filler = ByteVocab().encode(" ")[0]
    for i, rec in enumerate(records):
        if rec["length"]:
            assert bucket_of[i] == rec["length"] // 64
        else:   # the story (after its leading blank) in whole segments: 1 to 4 of them
            content = tokens.shape[1] - np.argmax(tokens[i] != filler)
            assert bucket_of[i] == -(-(content - 1) // 64) >= 1
    short = sorted(k for k in buckets if k < 4)
    assert short, "stories of 5 facts fill fewer than 4 segments of 64 bytes"
    stream = EpisodeStream(m, "train", 2, seed=0)
    SegmentCurriculum(CurriculumConfig(segments=[*short, 4], every=5), stream, m, str(out))
    stream.set_segments(short[0])
    segs = next(iter(stream))
    assert len(segs) == short[0] and bool(segs[0].reset.all())


def test_a_length_curriculum_names_the_lengths_the_data_has(tmp_path, texts):
    from model import ConfigError
    from train.config import CurriculumConfig
    from train.curriculum import SegmentCurriculum

    out = _build(tmp_path / "together", texts, "--together", lengths="256,512")
    m = load_manifest(str(out))
    stream = EpisodeStream(m, "train", 4, seed=0)
    good = SegmentCurriculum(CurriculumConfig(segments=[4, 8], every=5), stream, m, str(out))
    good.start(resumed=False)
    assert stream.n_segments == 4 and good.after_step(5) == 8 and stream.n_segments == 8
    with pytest.raises(ConfigError, match=r"has samples of \[4, 8\] segments, not \[2\]"):
        SegmentCurriculum(CurriculumConfig(segments=[2, 8], every=5), stream, m, str(out))
