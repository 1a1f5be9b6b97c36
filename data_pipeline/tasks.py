"""The algorithmic tasks of the RMT paper (Bulatov et al. 2022, §4 and App. A): copy, reverse,
associative retrieval and quadratic equations, as seeded numpy token streams; and the
"rewrite" variant of associative retrieval that ARMT is evaluated on (Rodkin et al. 2024,
arXiv 2407.04841; docs/armt-tasks.md).

Every sample is one stream `tokens[T+1]`: input = tokens[:-1], target = tokens[1:], and the
trainer cuts the T positions into `n_segments` equal segments (memory starts fresh per
sample: README.md "BPTT and memory", episodic data). Masks live on the T target positions:
`loss_mask` is where the training loss is taken (never on the source before the
start-to-generate token: the source is random, nothing there can be predicted),
`answer_mask` is what the task metric scores.

Formats, ids and the decisions the paper leaves open. Tags: [C] as in the authors' code,
[I] our interpretation where the paper and the code leave it open:

copy [C]      ids: pad 0, start 1, symbols 2..9 (vocab 10). Stream [x, 1, x, x], T = 3L;
              loss = answer = the last 2L target positions.
reverse [C]   same ids; stream [x, 1, reversed x], T = 2L; loss = answer = the last L.
associative_retrieval [C]
              values are digits, ids 0..9; start 10; keys are letters, ids 11..36. Keys and
              values are sampled without replacement; the query is one of the keys. Stream
              k1 v1 .. kK vK q 10 v*, T = 2K + 2 (10 for K = 4). Loss = answer = the last
              position. [I] pad id 37 (the digit values own id 0), vocab 38; pad never occurs
              in a generated stream, it is there for consumers that need one.
associative_rewrite (ARMT's "rewrite" setting; [A] as in the ARMT authors' code, [I] ours)
              the ids, vocab and pad of associative_retrieval. n_pairs distinct keys (1..26)
              with values drawn with replacement [A: values are random digits], then
              n_rewrites pairs each re-assigning an already-written key [A: keys repeat in a
              sample] to a value different from its current one [I: so every rewrite changes
              what the key means]; the key of each rewrite is uniform over the n_pairs keys,
              so a key can be rewritten several times. Stream k1 v1 .. kK vK r1 w1 .. rR wR
              q 10 v*, T = 2(K + R) + 2 (14 for the defaults K = 4, R = 2); v* is the value
              most recently assigned to q [A]. [I] q is, with probability 1/2, uniform over
              the keys that were rewritten, else uniform over all K keys (the authors draw it
              uniformly over the distinct keys): at least half of the queries need the latest
              value, not the first. Loss = answer = the last position.
quadratic     6 fields x 30 characters: equation | canonic form | discriminant | root 1 |
              root 2 | answer [C]; digits -> 2..11, "+-*/^=()xD;," -> 12..23, pad 0 [C].
              [I] The stream is one start token (id 1, the 'g' of the authors' vocabulary)
              followed by the 180 characters, so T = 180 and target field f sits exactly on
              target positions 30f .. 30f+29: one segment of 180 or six of 30 (paper §A.3).
              Loss on target positions 30..179 (the code's answer_size=150, everything after
              the equation); answer_mask on 150..179, the answer field INCLUDING its padding,
              so an exact match also requires the model to stop (and, for an equation without
              real roots, to leave the field empty).
              [I] Field strings (the paper's example is reproduced exactly, see
              `quadratic_fields(6, 92, -4)`): explicit coefficients everywhere except the
              leading x^2 of the canonic form, so `1*x^2+0*x-36=0` can occur; a negative q is
              parenthesised in the discriminant (`-4*1*(-36)`); the roots are written in
              ascending order (the (-p-s)/2 root first), as in the example.
              [C] alpha is a nonzero integer in [-10, 10] (random magnitude 1..10, random sign).
              [I] Equations without real roots (`no_root_percent`, default 20, exactly that
              share of every generated set, rounded): p is drawn as -(x1+x2) from two uniform
              roots like the solvable ones, then q uniformly with p^2 - 4q < 0 and
              q <= max(10000, p^2//4 + 1), so |q| stays in the solvable range; the equation is
              alpha*(x^2+p*x+q)=0. Their discriminant field stops at the negative value
              (`D=98^2-4*1*2500=-396`, no `=s^2`), and both root fields and the answer field
              are empty (all pad).

The paper's split sizes for copy-24, reverse-24 and AR are 100k/5k/10k (DEFAULT_SPLIT_SIZES);
the authors' notebook and the quadratic task use 100k/10k/20k. Splits are drawn
independently (`split_seed`); unlike the authors' pipeline nothing removes duplicates or
train/test overlap, which matters only for the small quadratic space (~800k equations).
Segments are equal: AR (T = 10) takes 1, 2, 5 or 10 of them. The paper's AR points with segment
lengths 4 and 3 came from torch.chunk's uneven chunks [C] and are not representable here.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from math import isqrt

import numpy as np

TASKS: tuple[str, ...] = ("copy", "reverse", "associative_retrieval", "associative_rewrite",
                          "quadratic")
DEFAULT_SPLIT_SIZES = {"train": 100_000, "valid": 5_000, "test": 10_000}  # paper §3.6

# copy / reverse [C: NUM_TOKENS=10]
COPY_PAD, COPY_START, COPY_FIRST_SYMBOL, COPY_VOCAB = 0, 1, 2, 10
DEFAULT_SRC_LEN = 24  # Fig. 3 source length

# associative retrieval [C]; AR_PAD is ours [I]
AR_START, AR_FIRST_KEY, AR_N_KEYS, AR_N_VALUES, AR_PAD, AR_VOCAB = 10, 11, 26, 10, 37, 38
DEFAULT_N_PAIRS = 4
# associative_rewrite: the default gives T = 14, seven segments of one pair each as in the
# ARMT authors' runs (segment = key, value). The cap keeps T <= 2 * (26 + 200) + 2 = 454,
# beyond the authors' largest rewrite setting (50 pairs).
DEFAULT_N_REWRITES, MAX_REWRITES = 2, 200
REWRITTEN_QUERY_SHARE = 0.5  # P(query drawn among the rewritten keys) when any was rewritten

# quadratic equations [C]
QUAD_PAD, QUAD_START = 0, 1
QUAD_CHARS = "0123456789+-*/^=()xD;,"  # ids 2..23 in this order
QUAD_VOCAB = 2 + len(QUAD_CHARS)
FIELD_LEN, N_FIELDS = 30, 6
QUAD_FIELDS = ("equation", "canonic", "discriminant", "root1", "root2", "answer")
ROOT_RANGE, MAX_ALPHA = 100, 10  # roots uniform in [-100, 100]; |alpha| in 1..10
MAX_NO_ROOT_Q = 10_000           # keeps q of rootless equations in the solvable range
DEFAULT_NO_ROOT_PERCENT = 20     # paper §A.3

_SPLITS = ("train", "valid", "test")
_ALLOWED_PARAMS = {"copy": (), "reverse": (), "associative_retrieval": ("n_pairs",),
                   "associative_rewrite": ("n_pairs", "n_rewrites"),
                   "quadratic": ("no_root_percent",)}
_AR_NAMES = ("associative_retrieval", "associative_rewrite")  # one alphabet (ids, render)

# character <-> id tables for the quadratic task; ' ' is the padding character while building
_QUAD_ID_OF_BYTE = np.zeros(256, dtype=np.int64)
for _i, _ch in enumerate(QUAD_CHARS):
    _QUAD_ID_OF_BYTE[ord(_ch)] = 2 + _i
_QUAD_CHAR_OF_ID = {QUAD_PAD: "_", **{2 + i: ch for i, ch in enumerate(QUAD_CHARS)}}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    vocab_size: int
    pad_id: int
    seq_len: int        # T: input positions of one sample (= target positions)
    n_segments: int     # T is divisible by n_segments
    params: dict = field(default_factory=dict, hash=False)  # e.g. {"src_len": 24}

    @property
    def segment_len(self) -> int:
        return self.seq_len // self.n_segments


@dataclass
class TaskData:
    tokens: np.ndarray       # [N, T+1] int64; input = tokens[:, :-1], target = tokens[:, 1:]
    loss_mask: np.ndarray    # [N, T] bool over target positions: where the loss is taken
    answer_mask: np.ndarray  # [N, T] bool: positions scored by the task metric

    @property
    def inputs(self) -> np.ndarray:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[:, 1:]


# ----------------------------------------------------------------------------- validation

def _int_param(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _seq_len(name: str, params: dict) -> int:
    if name == "copy":
        return 3 * params["src_len"]
    if name == "reverse":
        return 2 * params["src_len"]
    if name == "associative_retrieval":
        return 2 * params["n_pairs"] + 2
    if name == "associative_rewrite":
        return 2 * (params["n_pairs"] + params["n_rewrites"]) + 2
    return N_FIELDS * FIELD_LEN


def make_task(name: str, *, src_len: int | None = None, n_segments: int = 1,
              **params) -> TaskSpec:
    """Validated task spec. copy/reverse take `src_len` (default 24); associative_retrieval
    takes `n_pairs` (default 4, at most 10: values are distinct digits); associative_rewrite
    takes `n_pairs` (default 4, at most 26: keys are distinct letters, values may repeat) and
    `n_rewrites` (default 2, at most MAX_REWRITES); quadratic takes `no_root_percent` (default
    20) and has the fixed length 180. Bad values raise ValueError naming the parameter and
    the numbers."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    unknown = sorted(set(params) - set(_ALLOWED_PARAMS[name]))
    if unknown:
        allowed = ", ".join(("src_len",) * (name in ("copy", "reverse"))
                            + _ALLOWED_PARAMS[name]) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for task {name!r}; "
                         f"it takes: {allowed}")
    n_segments = _int_param("n_segments", n_segments, 1)
    if name in ("copy", "reverse"):
        src = DEFAULT_SRC_LEN if src_len is None else src_len
        clean = {"src_len": _int_param("src_len", src, 1)}
        vocab, pad = COPY_VOCAB, COPY_PAD
    elif src_len is not None:
        what = {"associative_retrieval": "n_pairs",
                "associative_rewrite": "n_pairs and n_rewrites"}.get(
                    name, "nothing (fixed length 180)")
        raise ValueError(f"src_len does not apply to task {name!r} (got src_len={src_len}); "
                         f"its length is set by {what}")
    elif name == "associative_retrieval":
        k = params.get("n_pairs", DEFAULT_N_PAIRS)
        clean = {"n_pairs": _int_param("n_pairs", k, 1, min(AR_N_KEYS, AR_N_VALUES))}
        vocab, pad = AR_VOCAB, AR_PAD
    elif name == "associative_rewrite":
        k = params.get("n_pairs", DEFAULT_N_PAIRS)
        r = params.get("n_rewrites", DEFAULT_N_REWRITES)
        clean = {"n_pairs": _int_param("n_pairs", k, 1, AR_N_KEYS),
                 "n_rewrites": _int_param("n_rewrites", r, 0, MAX_REWRITES)}
        vocab, pad = AR_VOCAB, AR_PAD
    else:
        pct = params.get("no_root_percent", DEFAULT_NO_ROOT_PERCENT)
        clean = {"no_root_percent": _int_param("no_root_percent", pct, 0, 100)}
        vocab, pad = QUAD_VOCAB, QUAD_PAD
    T = _seq_len(name, clean)
    if T % n_segments:
        works = ", ".join(map(str, _divisors(T)))
        raise ValueError(f"seq_len {T} of task {name!r} is not divisible by n_segments="
                         f"{n_segments}; segment counts that work: {works}")
    return TaskSpec(name, vocab, pad, T, n_segments, clean)


def split_seed(base_seed: int, split: str) -> int:
    """A seed per (base_seed, split), distinct across splits and stable across runs and
    platforms (a hash, not Python's salted hash())."""
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(_SPLITS)}")
    base_seed = _int_param("base_seed", base_seed, 0)
    digest = hashlib.blake2b(f"memtrain-tasks:{base_seed}:{split}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1  # < 2**63


# ----------------------------------------------------------------------------- quadratic

def quadratic_fields_canonic(p: int, q: int, alpha: int) -> list[str]:
    """The six field strings of alpha*(x^2 + p*x + q) = 0 (see the module docstring).
    Raises ValueError if the roots are real but not integers (not part of this task) or if a
    field does not fit in FIELD_LEN characters."""
    p, q, alpha = operator.index(p), operator.index(q), operator.index(alpha)
    if alpha == 0:
        raise ValueError("alpha must be nonzero")
    d = p * p - 4 * q
    q_str = str(q) if q >= 0 else f"({q})"
    fields = [f"{alpha}*x^2{alpha * p:+d}*x{alpha * q:+d}=0",
              f"x^2{p:+d}*x{q:+d}=0",
              f"D={abs(p)}^2-4*1*{q_str}={d}"]
    if d < 0:
        fields += ["", "", ""]
    else:
        s = isqrt(d)
        if s * s != d:
            raise ValueError(f"x^2{p:+d}*x{q:+d}=0 has irrational roots (D={d})")
        r1, r2 = (-p - s) // 2, (-p + s) // 2  # exact: p and s have the same parity
        fields[2] += f"={s}^2"
        fields += [f"x=({-p}-{s})/2={r1}", f"x=({-p}+{s})/2={r2}", f"{r1},{r2}"]
    for name, text in zip(QUAD_FIELDS, fields, strict=True):
        if len(text) > FIELD_LEN:
            raise ValueError(f"quadratic {name} field {text!r} has {len(text)} characters, "
                             f"more than FIELD_LEN={FIELD_LEN} (p={p}, q={q}, alpha={alpha})")
    return fields


def quadratic_fields(x1: int, x2: int, alpha: int) -> list[str]:
    """Fields of alpha*(x-x1)*(x-x2) = 0. quadratic_fields(6, 92, -4) gives the paper's
    example: ['-4*x^2+392*x-2208=0', 'x^2-98*x+552=0', 'D=98^2-4*1*552=7396=86^2',
    'x=(98-86)/2=6', 'x=(98+86)/2=92', '6,92']; ';'.join(fields[1:5]) is its solution."""
    x1, x2 = operator.index(x1), operator.index(x2)
    return quadratic_fields_canonic(-(x1 + x2), x1 * x2, alpha)


def _quadratic(spec: TaskSpec, n: int, rng: np.random.Generator) -> TaskData:
    x = rng.integers(-ROOT_RANGE, ROOT_RANGE, size=(2, n), endpoint=True)
    alpha = rng.integers(1, MAX_ALPHA, size=n, endpoint=True) * (2 * rng.integers(0, 2, n) - 1)
    p, q = -(x[0] + x[1]), x[0] * x[1]
    n_none = (n * spec.params["no_root_percent"] + 50) // 100
    none = rng.permutation(n)[:n_none]
    lo = p[none] ** 2 // 4 + 1  # smallest q with p^2 - 4q < 0
    q[none] = rng.integers(lo, np.maximum(MAX_NO_ROOT_Q, lo), endpoint=True)
    rows = ["".join(f.ljust(FIELD_LEN) for f in quadratic_fields_canonic(*args))
            for args in zip(p.tolist(), q.tolist(), alpha.tolist(), strict=True)]
    chars = np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8)
    tokens = np.empty((n, spec.seq_len + 1), dtype=np.int64)
    tokens[:, 0] = QUAD_START
    tokens[:, 1:] = _QUAD_ID_OF_BYTE[chars].reshape(n, spec.seq_len)
    loss = np.zeros((n, spec.seq_len), dtype=bool)
    loss[:, FIELD_LEN:] = True  # everything after the equation [C: answer_size=150]
    answer = np.zeros_like(loss)
    answer[:, -FIELD_LEN:] = True  # the answer field, padding included (exact match)
    return TaskData(tokens, loss, answer)


# ----------------------------------------------------------------------------- generation

def _copy_reverse(spec: TaskSpec, n: int, rng: np.random.Generator) -> TaskData:
    L = spec.params["src_len"]
    x = rng.integers(COPY_FIRST_SYMBOL, COPY_VOCAB, size=(n, L))
    start = np.full((n, 1), COPY_START, dtype=np.int64)
    target = [x, x] if spec.name == "copy" else [x[:, ::-1]]
    tokens = np.concatenate([x, start, *target], axis=1).astype(np.int64)
    mask = np.zeros((n, spec.seq_len), dtype=bool)
    mask[:, L:] = True  # target position j predicts tokens[j+1]: everything after the start
    return TaskData(tokens, mask, mask.copy())


def _associative_retrieval(spec: TaskSpec, n: int, rng: np.random.Generator) -> TaskData:
    k = spec.params["n_pairs"]
    # without replacement per row: the first k of a random permutation of each row
    keys = np.argsort(rng.random((n, AR_N_KEYS)), axis=1)[:, :k] + AR_FIRST_KEY
    values = np.argsort(rng.random((n, AR_N_VALUES)), axis=1)[:, :k]
    pick = rng.integers(0, k, size=n)
    rows = np.arange(n)
    tokens = np.empty((n, 2 * k + 3), dtype=np.int64)
    tokens[:, 0:2 * k:2] = keys
    tokens[:, 1:2 * k:2] = values
    tokens[:, 2 * k] = keys[rows, pick]
    tokens[:, 2 * k + 1] = AR_START
    tokens[:, 2 * k + 2] = values[rows, pick]
    mask = np.zeros((n, spec.seq_len), dtype=bool)
    mask[:, -1] = True
    return TaskData(tokens, mask, mask.copy())


def _associative_rewrite(spec: TaskSpec, n: int, rng: np.random.Generator) -> TaskData:
    k, r = spec.params["n_pairs"], spec.params["n_rewrites"]
    rows = np.arange(n)
    keys = np.argsort(rng.random((n, AR_N_KEYS)), axis=1)[:, :k] + AR_FIRST_KEY  # distinct
    current = rng.integers(0, AR_N_VALUES, size=(n, k))  # the value each key holds now
    tokens = np.empty((n, 2 * (k + r) + 3), dtype=np.int64)
    tokens[:, 0:2 * k:2] = keys
    tokens[:, 1:2 * k:2] = current
    target = rng.integers(0, k, size=(n, r))  # which key each rewrite re-assigns
    # a uniform value among the AR_N_VALUES - 1 others: the rewrite always changes the value
    shift = rng.integers(1, AR_N_VALUES, size=(n, r))
    rewritten = np.zeros((n, k), dtype=bool)
    for j in range(r):  # sequential: a rewrite depends on the value the previous ones left
        pos = 2 * (k + j)
        current[rows, target[:, j]] = (current[rows, target[:, j]] + shift[:, j]) % AR_N_VALUES
        rewritten[rows, target[:, j]] = True
        tokens[:, pos] = keys[rows, target[:, j]]
        tokens[:, pos + 1] = current[rows, target[:, j]]
    # the query: with probability REWRITTEN_QUERY_SHARE uniform among the rewritten keys
    # (argmax of random scores restricted to them), else uniform among all keys
    among_rewritten = np.argmax(np.where(rewritten, rng.random((n, k)), -1.0), axis=1)
    anywhere = rng.integers(0, k, size=n)
    use_rewritten = (rng.random(n) < REWRITTEN_QUERY_SHARE) & rewritten.any(axis=1)
    pick = np.where(use_rewritten, among_rewritten, anywhere)
    tokens[:, -3] = keys[rows, pick]
    tokens[:, -2] = AR_START
    tokens[:, -1] = current[rows, pick]
    mask = np.zeros((n, spec.seq_len), dtype=bool)
    mask[:, -1] = True
    return TaskData(tokens, mask, mask.copy())


_GENERATORS = {"copy": _copy_reverse, "reverse": _copy_reverse,
               "associative_retrieval": _associative_retrieval,
               "associative_rewrite": _associative_rewrite, "quadratic": _quadratic}


def generate(spec: TaskSpec, n_samples: int, seed: int) -> TaskData:
    """`n_samples` samples of `spec`, a deterministic function of (spec, n_samples, seed)."""
    if spec.name not in _GENERATORS:
        raise ValueError(f"unknown task {spec.name!r}; choose one of {', '.join(TASKS)}")
    if spec.seq_len != _seq_len(spec.name, spec.params):
        raise ValueError(f"spec.seq_len {spec.seq_len} does not match params {spec.params}; "
                         "build specs with make_task")
    n_samples = _int_param("n_samples", n_samples, 0)
    seed = _int_param("seed", seed, 0)
    return _GENERATORS[spec.name](spec, n_samples, np.random.default_rng(seed))


# ----------------------------------------------------------------------------- inspection

def _copy_char(t: int) -> str:
    if COPY_FIRST_SYMBOL <= t < COPY_VOCAB:
        return str(t)
    return {COPY_PAD: "_", COPY_START: ">"}.get(t, "?")


def _ar_char(t: int) -> str:
    if 0 <= t < AR_N_VALUES:
        return str(t)
    if AR_FIRST_KEY <= t < AR_FIRST_KEY + AR_N_KEYS:
        return chr(ord("a") + t - AR_FIRST_KEY)
    return {AR_START: ">", AR_PAD: "_"}.get(t, "?")


def symbol_chars(spec: TaskSpec) -> list[str]:
    """The character each task id stands for, ids 0 .. vocab_size-1: render's alphabet, with
    the start token '>' and the pad '_' in every task (distinct from every other symbol).
    `memtrain tasks --tokenizer hf:...` writes each id as the model's token of its character
    (hf_tokenizer.HFVocab.single_token_ids)."""
    if spec.name in ("copy", "reverse"):
        return [_copy_char(i) for i in range(COPY_VOCAB)]
    if spec.name in _AR_NAMES:
        return [_ar_char(i) for i in range(AR_VOCAB)]
    if spec.name != "quadratic":
        raise ValueError(f"unknown task {spec.name!r}")
    return [{QUAD_START: ">"}.get(i) or _QUAD_CHAR_OF_ID[i] for i in range(QUAD_VOCAB)]


def render(spec: TaskSpec, tokens: np.ndarray) -> str:
    """One sample as text. copy/reverse: symbols as their ids 2..9, start '>', pad '_'
    ("3527>35273527"). associative retrieval and rewrite: keys a..z, values 0..9, start '>'
    ("a1b2c3d4c>3", "a1b2c3d4c7a5c>7").
    quadratic: the six fields joined by '|', trailing padding dropped, pad inside a field '_';
    takes a full row [181] (leading start token dropped) or a target/prediction row [180]."""
    ids = np.asarray(tokens).reshape(-1).tolist()
    if spec.name in ("copy", "reverse"):
        return "".join(map(_copy_char, ids))
    if spec.name in _AR_NAMES:
        return "".join(map(_ar_char, ids))
    if spec.name != "quadratic":
        raise ValueError(f"unknown task {spec.name!r}")
    if len(ids) == spec.seq_len + 1:
        ids = ids[1:]
    if len(ids) != spec.seq_len:
        raise ValueError(f"a quadratic sample has {spec.seq_len + 1} tokens (or {spec.seq_len}"
                         f" targets), got {len(ids)}")
    text = "".join(_QUAD_CHAR_OF_ID.get(t, "?") for t in ids)
    return "|".join(text[i:i + FIELD_LEN].rstrip("_") for i in range(0, len(text), FIELD_LEN))


def accuracy(spec: TaskSpec, predictions: np.ndarray, data: TaskData) -> float:
    """Test metric (RMT paper §4): per-character accuracy over `answer_mask` for copy,
    reverse and associative retrieval (and rewrite: one answer position, so per sample); for
    quadratic the share of samples whose every answer position (the whole padded answer
    field) is right. `predictions` are target ids [N, T]."""
    preds = np.asarray(predictions)
    if preds.shape != data.answer_mask.shape:
        raise ValueError(f"predictions have shape {preds.shape}, expected "
                         f"{data.answer_mask.shape} (N samples x T target positions)")
    if not data.answer_mask.any():
        raise ValueError("no answer positions to score (empty data?)")
    correct = preds == data.targets
    if spec.name == "quadratic":
        return float(np.all(correct | ~data.answer_mask, axis=1).mean())
    return float(correct[data.answer_mask].mean())
