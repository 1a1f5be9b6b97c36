"""The RMT algorithmic tasks (RMT paper §4 and App. A; data_pipeline/tasks.py): layouts,
the paper's quadratic example, masks, determinism, validation and the metric."""

import re

import numpy as np
import pytest

from data_pipeline.tasks import (
    AR_START,
    COPY_START,
    DEFAULT_SPLIT_SIZES,
    FIELD_LEN,
    QUAD_START,
    TASKS,
    TaskData,
    accuracy,
    generate,
    make_task,
    quadratic_fields,
    quadratic_fields_canonic,
    render,
    split_seed,
)

PAPER_EQUATION = "-4*x^2+392*x-2208=0"
PAPER_SOLUTION = "x^2-98*x+552=0;D=98^2-4*1*552=7396=86^2;x=(98-86)/2=6;x=(98+86)/2=92"
PAPER_ANSWER = "6,92"


def _data(name, n=64, seed=0, **kw):
    spec = make_task(name, **kw)
    return spec, generate(spec, n, seed)


# ----------------------------------------------------------------------------- layouts

def test_copy_target_is_the_source_twice_after_the_start_token():
    spec, data = _data("copy", src_len=24)
    assert data.tokens.shape == (64, 3 * 24 + 1) and data.tokens.dtype == np.int64
    assert (data.tokens[:, 24] == COPY_START).all()
    source = data.tokens[:, :24]
    assert source.min() >= 2 and source.max() <= 9 and len(np.unique(source)) == 8
    for row in data.tokens:
        src, tgt = render(spec, row).split(">")
        assert len(src) == 24 and tgt == src + src


def test_reverse_target_is_the_reversed_source_after_the_start_token():
    spec, data = _data("reverse", src_len=24)
    assert data.tokens.shape == (64, 2 * 24 + 1)
    for row in data.tokens:
        src, tgt = render(spec, row).split(">")
        assert len(src) == 24 and tgt == src[::-1] and src != tgt


@pytest.mark.parametrize("n_pairs", [4, 7])
def test_associative_retrieval_answer_is_the_queried_keys_value_with_distinct_keys_and_values(
        n_pairs):
    spec, data = _data("associative_retrieval", n=200, n_pairs=n_pairs)
    k = n_pairs
    assert spec.seq_len == 2 * k + 2 and data.tokens.shape == (200, 2 * k + 3)
    assert (data.tokens[:, 2 * k + 1] == AR_START).all()
    queried = set()
    for row in data.tokens:
        text = render(spec, row)
        keys, values, query = text[0:2 * k:2], text[1:2 * k:2], text[2 * k]
        assert keys.isalpha() and values.isdigit() and text[2 * k + 1] == ">"
        assert len(set(keys)) == k and len(set(values)) == k  # without replacement
        assert text[-1] == dict(zip(keys, values, strict=True))[query]
        queried.add(keys.index(query))
    assert queried == set(range(k))  # any pair can be asked, not only the first


_EQ = re.compile(r"(-?\d+)\*x\^2([+-]\d+)\*x([+-]\d+)=0")
_CANON = re.compile(r"x\^2([+-]\d+)\*x([+-]\d+)=0")
_DISC = re.compile(r"D=(\d+)\^2-4\*1\*\(?(-?\d+)\)?=(-?\d+)(?:=(\d+)\^2)?")
_ROOT = re.compile(r"x=\((-?\d+)([+-])(\d+)\)/2=(-?\d+)")


def _parse_quadratic(text):
    """Check one rendered quadratic sample field by field; return whether it has real roots."""
    eq, canon, disc, root1, root2, answer = text.split("|")
    a, b, c = map(int, _EQ.fullmatch(eq).groups())
    p, q = map(int, _CANON.fullmatch(canon).groups())
    assert 1 <= abs(a) <= 10 and (b, c) == (a * p, a * q)  # the equation is alpha * canonic
    p_abs, q_disc, d, s = _DISC.fullmatch(disc).groups()
    assert (int(p_abs), int(q_disc), int(d)) == (abs(p), q, p * p - 4 * q)
    if int(d) < 0:
        assert s is None and root1 == root2 == answer == ""
        return False
    assert int(s) ** 2 == int(d)
    roots = []
    for field, sign in ((root1, "-"), (root2, "+")):
        minus_p, op, s_root, r = _ROOT.fullmatch(field).groups()
        assert (int(minus_p), op, int(s_root)) == (-p, sign, int(s))
        assert int(r) == (-p + (int(s) if sign == "+" else -int(s))) // 2
        roots.append(int(r))
    assert answer == f"{roots[0]},{roots[1]}" and roots[0] <= roots[1]
    for r in roots:
        assert -100 <= r <= 100 and a * r * r + b * r + c == 0  # roots satisfy the equation
    return True


def test_quadratic_fields_parse_back_and_the_roots_satisfy_the_equation():
    spec, data = _data("quadratic", n=300, seed=3)
    assert data.tokens.shape == (300, 181) and (data.tokens[:, 0] == QUAD_START).all()
    real = [_parse_quadratic(render(spec, row)) for row in data.tokens]
    assert 0 < sum(real) < len(real)
    # render also reads a target/prediction row (no start token)
    assert render(spec, data.targets[0]) == render(spec, data.tokens[0])


def test_quadratic_reproduces_the_paper_example_exactly():
    fields = quadratic_fields(6, 92, -4)
    assert fields[0] == PAPER_EQUATION
    assert ";".join(fields[1:5]) == PAPER_SOLUTION
    assert fields[5] == PAPER_ANSWER
    assert quadratic_fields(92, 6, -4) == fields  # the answer lists the roots in order


def test_quadratic_tokens_follow_the_authors_vocabulary_and_field_layout():
    spec, data = _data("quadratic", n=50, seed=1)
    assert spec.vocab_size == 24 and spec.pad_id == 0
    assert data.tokens.min() >= 0 and data.tokens.max() <= 23
    fields = data.targets.reshape(50, 6, FIELD_LEN)
    assert (fields[:, 2, :2] == [21, 17]).all()  # every discriminant field starts "D="
    assert (fields[:, 1, :3] == [20, 16, 4]).all()  # every canonic form starts "x^2"
    digits = {str(i): 2 + i for i in range(10)}
    ops = dict(zip("+-*/^=()xD;,", range(12, 24), strict=True))
    for row, tok in zip(data.tokens, fields, strict=True):
        for text, ids in zip(render(spec, row).split("|"), tok, strict=True):
            expected = [digits.get(ch, ops.get(ch)) for ch in text]
            assert ids.tolist() == expected + [0] * (FIELD_LEN - len(text))


def test_quadratic_fields_fit_30_characters_for_every_root_pair_and_alpha():
    # alpha only enters the equation field, whose length grows with |alpha| and gets one
    # more character from a negative leading coefficient: alpha = -10 is the worst case.
    # The order of the roots does not change the strings, so x1 <= x2 covers every pair.
    longest = [0] * 6
    for x1 in range(-100, 101):
        for x2 in range(x1, 101):
            for i, text in enumerate(quadratic_fields(x1, x2, -10)):
                longest[i] = max(longest[i], len(text))
    # rootless equations: p in [-200, 200], q from p^2//4 + 1 up to max(10000, that);
    # lengths grow with |q| and |D| = 4q - p^2, so both ends of the q range bound them
    for p in range(-200, 201):
        lo = p * p // 4 + 1
        for q in (lo, max(10_000, lo)):
            for i, text in enumerate(quadratic_fields_canonic(p, q, -10)):
                longest[i] = max(longest[i], len(text))
    assert max(longest) <= FIELD_LEN
    assert longest[2] == FIELD_LEN  # e.g. "D=90^2-4*1*(-1000)=12100=110^2": no slack


def test_quadratic_field_too_long_or_irrational_roots_raise_value_error():
    with pytest.raises(ValueError, match="more than FIELD_LEN=30"):
        quadratic_fields(1000, -1000, -10)
    with pytest.raises(ValueError, match="irrational"):
        quadratic_fields_canonic(0, -2, 1)
    with pytest.raises(ValueError, match="alpha"):
        quadratic_fields(1, 2, 0)


def test_about_20_percent_of_quadratic_equations_have_no_real_roots():
    spec, data = _data("quadratic", n=2000, seed=7)
    answers = data.targets[:, -FIELD_LEN:]
    no_root = (answers == 0).all(axis=1)
    assert 0.15 < no_root.mean() < 0.25
    assert no_root.sum() == 400  # the share is exact, rounded: 20% of 2000
    # no answer <=> negative discriminant (a '-' right after "D=..^2-4*1*q=")
    for row, empty in zip(data.tokens[:200], no_root[:200], strict=True):
        d = int(render(spec, row).split("|")[2].split("=")[2])
        assert (d < 0) == empty
    _, none = _data("quadratic", n=200, no_root_percent=0)
    assert not (none.targets[:, -FIELD_LEN:] == 0).all(axis=1).any()


# ----------------------------------------------------------------------------- masks

@pytest.mark.parametrize("name, kw, loss, answer", [
    ("copy", {"src_len": 5}, (5, 15), (5, 15)),
    ("reverse", {"src_len": 5}, (5, 10), (5, 10)),
    ("associative_retrieval", {}, (9, 10), (9, 10)),
    ("quadratic", {"n_segments": 6}, (30, 180), (150, 180)),
])
def test_masks_mark_exactly_the_target_positions_after_the_start_token(name, kw, loss, answer):
    spec, data = _data(name, n=32, **kw)
    T = spec.seq_len
    for mask, (lo, hi) in ((data.loss_mask, loss), (data.answer_mask, answer)):
        expected = np.zeros(T, dtype=bool)
        expected[lo:hi] = True
        assert mask.shape == (32, T) and mask.dtype == bool
        assert (mask == expected).all()
    assert not (data.answer_mask & ~data.loss_mask).any()  # the answer is always trained
    if name == "quadratic":  # six segments of 30 = six fields; the answer is the last one
        per_segment = data.answer_mask.reshape(32, 6, spec.segment_len).all(axis=2)
        assert (per_segment == [False] * 5 + [True]).all()
        return
    start = COPY_START if name in ("copy", "reverse") else AR_START
    start_pos = np.argmax(data.tokens == start, axis=1)  # first start token in the stream
    target_pos = np.arange(T)[None, :] + 1  # target position j predicts tokens[j + 1]
    assert not (data.loss_mask & (target_pos <= start_pos[:, None])).any()


# ----------------------------------------------------------------------------- determinism

@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_data_and_different_split_seeds_different_data(name):
    spec = make_task(name, src_len=8) if name in ("copy", "reverse") else make_task(name)
    a, b = generate(spec, 40, split_seed(5, "train")), generate(spec, 40, split_seed(5, "train"))
    for field in ("tokens", "loss_mask", "answer_mask"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    others = [generate(spec, 40, split_seed(5, s)).tokens for s in ("valid", "test")]
    others.append(generate(spec, 40, split_seed(6, "train")).tokens)
    for tokens in others:
        assert not np.array_equal(tokens, a.tokens)


def test_split_seeds_are_distinct_and_stable_across_runs():
    seeds = {split_seed(base, split) for base in range(50) for split in DEFAULT_SPLIT_SIZES}
    assert len(seeds) == 150
    assert split_seed(0, "train") == 5343492828694852803  # a hash, not Python's salted hash()
    with pytest.raises(ValueError, match="split"):
        split_seed(0, "validation")
    assert DEFAULT_SPLIT_SIZES == {"train": 100_000, "valid": 5_000, "test": 10_000}


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("name, n_segments, segment_lens", [
    ("copy", (1, 3, 6, 9), (72, 24, 12, 8)),     # Fig. 3
    ("reverse", (1, 2, 4, 6), (48, 24, 12, 8)),  # Fig. 3
    ("associative_retrieval", (1, 2, 5), (10, 5, 2)),
    ("quadratic", (1, 6), (180, 30)),            # §A.3
])
def test_paper_segmentations_are_accepted(name, n_segments, segment_lens):
    for n, length in zip(n_segments, segment_lens, strict=True):
        assert make_task(name, n_segments=n).segment_len == length


@pytest.mark.parametrize("name, kw, match", [
    ("sort", {}, "unknown task 'sort'"),
    ("copy", {"src_len": 0}, "src_len must be >= 1, got 0"),
    ("reverse", {"src_len": -3}, "src_len must be >= 1, got -3"),
    ("copy", {"src_len": 2.5}, "src_len must be an integer"),
    ("copy", {"n_segments": 0}, "n_segments must be >= 1, got 0"),
    ("copy", {"src_len": 24, "n_segments": 5},
     r"seq_len 72 .* n_segments=5; segment counts that work: 1, 2, 3, 4, 6, 8, 9, 12, 18"),
    ("reverse", {"src_len": 24, "n_segments": 5}, r"seq_len 48 .* n_segments=5"),
    ("associative_retrieval", {"n_segments": 3}, r"seq_len 10 .* work: 1, 2, 5, 10$"),
    ("quadratic", {"n_segments": 7}, r"seq_len 180 .* n_segments=7"),
    ("associative_retrieval", {"n_pairs": 11}, r"n_pairs must be in \[1, 10\], got 11"),
    ("associative_retrieval", {"n_pairs": 0}, "n_pairs"),
    ("associative_retrieval", {"src_len": 9}, "src_len does not apply"),
    ("quadratic", {"src_len": 30}, "src_len does not apply"),
    ("copy", {"n_pairs": 4}, "unknown parameter.*n_pairs.*it takes: src_len"),
    ("quadratic", {"no_root_percent": 101}, "no_root_percent"),
])
def test_bad_parameters_raise_value_error_naming_the_parameter(name, kw, match):
    with pytest.raises(ValueError, match=match):
        make_task(name, **kw)


def test_generate_rejects_bad_sample_counts_seeds_and_hand_made_specs():
    spec = make_task("copy", src_len=4)
    with pytest.raises(ValueError, match="n_samples"):
        generate(spec, -1, 0)
    with pytest.raises(ValueError, match="seed"):
        generate(spec, 1, -1)
    bad = type(spec)("copy", 10, 0, 13, 1, {"src_len": 4})
    with pytest.raises(ValueError, match="seq_len 13"):
        generate(bad, 1, 0)


# ----------------------------------------------------------------------------- metric

def test_accuracy_is_one_when_perfect_and_the_wrong_fraction_when_corrupted():
    spec, data = _data("copy", n=10, src_len=4)  # 10 samples x 8 answer positions
    preds = data.targets.copy()
    assert accuracy(spec, preds, data) == 1.0
    preds[:, 0] = 0  # the source part is not scored
    assert accuracy(spec, preds, data) == 1.0
    preds[0, 4] = 0  # 3 wrong characters of 80
    preds[3, 11] = 0
    preds[9, 7] = 0
    assert accuracy(spec, preds, data) == pytest.approx(77 / 80)
    with pytest.raises(ValueError, match="shape"):
        accuracy(spec, preds[:, :-1], data)

    spec, data = _data("associative_retrieval", n=8)
    preds = data.targets.copy()
    preds[:4, -1] = (preds[:4, -1] + 1) % 10
    assert accuracy(spec, preds, data) == 0.5


def test_quadratic_accuracy_is_whole_answer_exact_match():
    spec, data = _data("quadratic", n=50, seed=2)
    preds = data.targets.copy()
    assert accuracy(spec, preds, data) == 1.0
    preds[:, 30:150] = 0  # a wrong solution with the right answer still counts
    assert accuracy(spec, preds, data) == 1.0
    preds[0, 150] = 23          # one wrong character
    preds[1, 150:153] = 23      # three wrong characters in one sample: still one sample
    preds[2, -1] = 5            # a character where the answer is padding
    assert accuracy(spec, preds, data) == pytest.approx(47 / 50)


# ----------------------------------------------------------------------------- speed

def test_100k_copy_24_samples_generate_in_one_vectorised_pass():
    spec = make_task("copy", src_len=24, n_segments=3)
    data = generate(spec, 100_000, split_seed(0, "train"))
    assert isinstance(data, TaskData)
    assert data.tokens.shape == (100_000, 73) and data.loss_mask.shape == (100_000, 72)
