"""associative_rewrite, the "rewrite" setting of associative retrieval that ARMT is evaluated on
(Rodkin et al. 2024, arXiv 2407.04841; data_pipeline/tasks.py, docs/armt-tasks.md): layout,
rewrites, the answer checked against a naive reading of the sample, the share of rewritten
queries, determinism, validation, the command, and plain associative_retrieval untouched."""

import hashlib

import numpy as np
import pytest
import torch

from data_pipeline.shards import load_manifest
from data_pipeline.streams import EpisodeStream
from data_pipeline.tasks import (
    AR_START,
    AR_VOCAB,
    MAX_REWRITES,
    accuracy,
    generate,
    make_task,
    render,
    split_seed,
    symbol_chars,
)
from memtrain.cli import main


def _data(n=400, seed=0, **kw):
    spec = make_task("associative_rewrite", **kw)
    return spec, generate(spec, n, seed)


def _pairs(text):
    """(key, value) pairs written before the query, the query key and the answer of one
    rendered sample 'k v k v ... q > v*'."""
    body, answer = text.split(">")
    return list(zip(body[:-1:2], body[1:-1:2], strict=True)), body[-1], answer


# ----------------------------------------------------------------------------- layout

@pytest.mark.parametrize("n_pairs, n_rewrites", [(4, 2), (1, 3), (10, 5), (26, 40)])
def test_layout_is_keys_values_then_rewrites_then_query_start_answer(n_pairs, n_rewrites):
    spec, data = _data(n_pairs=n_pairs, n_rewrites=n_rewrites)
    T = 2 * (n_pairs + n_rewrites) + 2
    assert spec.seq_len == T and spec.vocab_size == AR_VOCAB
    assert data.tokens.shape == (400, T + 1) and data.tokens.dtype == np.int64
    assert (data.tokens[:, -2] == AR_START).all()
    for row in data.tokens[:50]:
        text = render(spec, row)
        assert len(text) == T + 1
        assert text[0:-3:2].isalpha() and text[1:-3:2].isdigit()   # k v k v ...
        assert text[-3].isalpha() and text[-2] == ">" and text[-1].isdigit()
    expected = np.zeros(T, dtype=bool)
    expected[-1] = True  # loss and score only on the answer
    assert (data.loss_mask == expected).all() and (data.answer_mask == expected).all()


def test_default_sample_splits_into_seven_segments_of_one_pair():
    spec = make_task("associative_rewrite", n_segments=7)
    assert spec.params == {"n_pairs": 4, "n_rewrites": 2}
    assert spec.seq_len == 14 and spec.segment_len == 2


# ----------------------------------------------------------------------------- rewrites

@pytest.mark.parametrize("n_pairs, n_rewrites", [(4, 2), (10, 12), (26, 5)])
def test_keys_are_distinct_before_the_rewrites_and_rewrites_reuse_written_keys(
        n_pairs, n_rewrites):
    spec, data = _data(n_pairs=n_pairs, n_rewrites=n_rewrites)
    for row in data.tokens:
        pairs, query, _ = _pairs(render(spec, row))
        first = [k for k, _ in pairs[:n_pairs]]
        assert len(set(first)) == n_pairs
        assert {k for k, _ in pairs[n_pairs:]} <= set(first)
        assert query in first


@pytest.mark.parametrize("n_pairs, n_rewrites", [(4, 2), (1, 6), (10, 12)])
def test_every_rewrite_changes_the_value_of_its_key(n_pairs, n_rewrites):
    spec, data = _data(n_pairs=n_pairs, n_rewrites=n_rewrites)
    seen_new_values = set()
    for row in data.tokens:
        pairs, _, _ = _pairs(render(spec, row))
        held = dict(pairs[:n_pairs])
        for key, value in pairs[n_pairs:]:
            assert value != held[key]
            held[key] = value
            seen_new_values.add(value)
    assert seen_new_values == set("0123456789")  # any other digit can be the new value


@pytest.mark.parametrize("n_pairs, n_rewrites", [(4, 2), (1, 1), (3, 9), (26, 30), (5, 0)])
def test_answer_is_the_value_most_recently_assigned_to_the_query_key(n_pairs, n_rewrites):
    spec, data = _data(n=300, seed=4, n_pairs=n_pairs, n_rewrites=n_rewrites)
    for row in data.tokens:
        pairs, query, answer = _pairs(render(spec, row))
        latest = None
        for key, value in pairs:  # naive: read the sample left to right
            if key == query:
                latest = value
        assert answer == latest


def test_some_key_is_rewritten_more_than_once_and_then_the_last_value_counts():
    spec, data = _data(n=300, n_pairs=2, n_rewrites=6)
    multi = 0
    for row in data.tokens:
        pairs, query, answer = _pairs(render(spec, row))
        rewrites_of_query = [v for k, v in pairs[2:] if k == query]
        multi += len(rewrites_of_query) > 1
        if rewrites_of_query:
            assert answer == rewrites_of_query[-1]
    assert multi > 100


# ----------------------------------------------------------------------------- queries

def _rewritten_query_share(spec, data):
    k, hits = spec.params["n_pairs"], []
    for row in data.tokens:
        pairs, query, _ = _pairs(render(spec, row))
        hits.append(query in {key for key, _ in pairs[k:]})
    return float(np.mean(hits))


@pytest.mark.parametrize("n_pairs, n_rewrites", [(4, 2), (10, 1), (26, 3)])
def test_at_least_half_of_the_queries_ask_a_rewritten_key_the_rest_any_key(n_pairs, n_rewrites):
    # P(rewritten) = 1/2 + 1/2 * (rewritten keys / n_pairs), at most 1/2 + 1/2 * R / K:
    # 0.55 for 10 keys and 1 rewrite; 0.03 is about 4 standard deviations at 4000 samples
    spec, data = _data(n=4000, seed=11, n_pairs=n_pairs, n_rewrites=n_rewrites)
    share = _rewritten_query_share(spec, data)
    assert 0.5 - 0.03 <= share <= 0.5 + 0.5 * n_rewrites / n_pairs + 0.03


def test_any_key_can_be_queried_and_no_rewrites_means_no_rewritten_query():
    spec, data = _data(n=500, n_pairs=6, n_rewrites=2)
    asked = {render(spec, row)[:12:2].index(render(spec, row)[-3]) for row in data.tokens}
    assert asked == set(range(6))
    spec, data = _data(n=200, n_pairs=6, n_rewrites=0)
    assert _rewritten_query_share(spec, data) == 0.0


# ----------------------------------------------------------------------------- determinism

def test_same_seed_same_data_and_other_seeds_other_data():
    spec = make_task("associative_rewrite", n_pairs=5, n_rewrites=3)
    a, b = generate(spec, 100, split_seed(2, "train")), generate(spec, 100, split_seed(2, "train"))
    for name in ("tokens", "loss_mask", "answer_mask"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    for other in (split_seed(2, "valid"), split_seed(3, "train")):
        assert not np.array_equal(generate(spec, 100, other).tokens, a.tokens)


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kw, match", [
    ({"n_pairs": 0}, r"n_pairs must be in \[1, 26\], got 0"),
    ({"n_pairs": 27}, r"n_pairs must be in \[1, 26\], got 27"),
    ({"n_rewrites": -1}, rf"n_rewrites must be in \[0, {MAX_REWRITES}\], got -1"),
    ({"n_rewrites": MAX_REWRITES + 1}, rf"n_rewrites must be in \[0, {MAX_REWRITES}\]"),
    ({"n_rewrites": 2.5}, "n_rewrites must be an integer"),
    ({"n_rewrites": True}, "n_rewrites must be an integer"),
    ({"no_root_percent": 5}, "unknown parameter.*no_root_percent.*n_pairs, n_rewrites"),
    ({"src_len": 4}, "src_len does not apply.*n_pairs and n_rewrites"),
    ({"n_segments": 5}, r"seq_len 14 .* n_segments=5; segment counts that work: 1, 2, 7, 14$"),
])
def test_bad_parameters_raise_value_error_naming_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        make_task("associative_rewrite", **kw)


def test_more_than_ten_keys_are_allowed_here_but_not_in_plain_associative_retrieval():
    assert make_task("associative_rewrite", n_pairs=26, n_rewrites=0).seq_len == 54
    with pytest.raises(ValueError, match=r"n_pairs must be in \[1, 10\]"):
        make_task("associative_retrieval", n_pairs=26)


# ----------------------------------------------------------------------------- render, metric

def test_render_uses_the_associative_retrieval_alphabet_and_accuracy_scores_the_answer():
    spec, data = _data(n=8)
    assert symbol_chars(spec) == symbol_chars(make_task("associative_retrieval"))
    assert render(spec, data.tokens[0]).count(">") == 1
    preds = data.targets.copy()
    assert accuracy(spec, preds, data) == 1.0
    preds[:, :-1] = 0  # only the answer is scored
    assert accuracy(spec, preds, data) == 1.0
    preds[:2, -1] = (preds[:2, -1] + 1) % 10
    assert accuracy(spec, preds, data) == 0.75


# ----------------------------------------------------------------------------- command

def test_tasks_command_writes_the_generated_samples_in_seven_segments(tmp_path):
    out = tmp_path / "rewrite"
    assert main(["tasks", "associative_rewrite", "--param", "n_pairs=4", "--param",
                 "n_rewrites=2", "--n-segments", "7", "--out", str(out), "--train-size", "16",
                 "--valid-size", "4", "--test-size", "4", "--seed", "3"]) == 0
    m = load_manifest(out)
    assert m.extra["task"] == "associative_rewrite" and m.extra["n_segments"] == 7
    assert m.extra["params"] == {"n_pairs": 4, "n_rewrites": 2}
    want = generate(make_task("associative_rewrite", n_segments=7), 16, split_seed(3, "train"))
    episode = next(iter(EpisodeStream(m, "train", 8, shuffle=False)))
    assert len(episode) == 7
    rebuilt = torch.cat([seg.tokens[:, :-1] for seg in episode], 1)
    assert torch.equal(rebuilt, torch.from_numpy(want.tokens[:8, :-1]))


def test_tasks_command_reports_a_bad_n_rewrites_with_exit_code_2(tmp_path, capsys):
    assert main(["tasks", "associative_rewrite", "--param", "n_rewrites=-2",
                 "--out", str(tmp_path / "x")]) == 2
    assert "n_rewrites must be in" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plain AR

# sha256 of tokens (int64 little-endian), loss_mask and answer_mask of 500 samples, seed
# split_seed(3, "train"), computed before associative_rewrite was added.
PLAIN_AR_FINGERPRINTS = {
    4: "4fe060ed780c52e6b6c56b4186e61346fff4a5bfc3401eb21f9f32ea513f8360",
    7: "442ef0e99be374a209b27d835a7a305e1bf9115d0d2cfb605d696243b02d759f",
    10: "3d9354ad17f7a7c9716c424b5f12632bed8b10a05f7acd3e0b2d7ffb484a9b9a",
}


@pytest.mark.parametrize("n_pairs", sorted(PLAIN_AR_FINGERPRINTS))
def test_plain_associative_retrieval_generates_the_same_bytes_as_before(n_pairs):
    spec = make_task("associative_retrieval", n_pairs=n_pairs)
    data = generate(spec, 500, split_seed(3, "train"))
    digest = hashlib.sha256(data.tokens.astype("<i8").tobytes() + data.loss_mask.tobytes()
                            + data.answer_mask.tobytes()).hexdigest()
    assert digest == PLAIN_AR_FINGERPRINTS[n_pairs]
