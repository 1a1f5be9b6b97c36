"""The mechanics of benchmarks/bench_pretrained.py on a tiny Llama built from a config:
segment checkpointing keeps a window's peak memory flat in the number of segments while the
full unroll's grows with it (measured as the benchmark measures it, peak RSS over one step),
and the no-memory baseline is the same checkpoint on the same tokens. Never timings."""

import ctypes
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_pretrained import Runner, parse_args, peak_of_step, save_backbone  # noqa: E402

# Large enough that a segment's activations (~8 MB) are far above the allocator's noise,
# small enough for a few seconds: 2 layers, d 128, L 64, m 8, batch 8.
SIZES = ["--n-layer=2", "--d-model=128", "--d-inner=256", "--vocab=256", "--seg-len=64",
         "--num-mem-tokens=8", "--batch=8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # What MALLOC_MMAP_THRESHOLD_=65536 does for the benchmark's children: blocks of 64 KiB
    # and more are mmapped, so freeing them lowers the RSS and the next peak is measurable.
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)   # M_MMAP_THRESHOLD
    a = parse_args(SIZES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield a, save_backbone(a, str(tmp_path_factory.mktemp("hf") / "llama"))
    torch.set_num_threads(threads)


def test_checkpointed_peak_stays_flat_while_the_full_unroll_grows_with_the_segments(setup):
    a, path = setup
    peak = {(mode, n): peak_of_step(Runner(a, path, mode, n, optimizer=False))["peak_mb"]
            for mode in ("ckpt", "unroll") for n in (1, 8)}
    assert peak[("ckpt", 8)] < 1.5 * peak[("ckpt", 1)], peak
    # Unrolled, each segment keeps its activations until the one backward.
    assert peak[("unroll", 8)] > 3 * peak[("unroll", 1)], peak
    assert peak[("unroll", 8)] > 3 * peak[("ckpt", 8)], peak


def test_the_baseline_is_the_same_checkpoint_without_memory_on_the_same_tokens(setup):
    a, path = setup
    rmt, base = (Runner(a, path, mode, 4, optimizer=True) for mode in ("ckpt", "base"))
    assert (rmt.model.num_mem_tokens, base.model.num_mem_tokens) == (8, 0)
    rmt_weights, base_weights = rmt.model.base.state_dict(), base.model.base.state_dict()
    assert rmt_weights.keys() == base_weights.keys()
    assert all(torch.equal(rmt_weights[k], base_weights[k]) for k in rmt_weights)
    assert torch.equal(rmt.data, base.data)
    assert rmt.text_tokens() == base.text_tokens() == 4 * 64 * 8
    # One step of each trains: the weights move.
    before = base.model.base.get_input_embeddings().weight.detach().clone()
    base.step()
    assert not torch.equal(before, base.model.base.get_input_embeddings().weight)
