"""Synthetic long-range streams, generated on the fly (no download).

`repeat_block_stream` makes the quickstart's stream (README.md "Quickstart"; run configs
`data.generate: repeat_blocks`): blocks [A | filler | A] where A is `block` random
symbols and the filler `filler` random symbols. The second copy of A is predictable only by a
model that remembers A across the filler; with segment length 32 the repeat lies about 64
tokens back, beyond one segment but inside memory + segment. A model without memory stays
near ln(n_symbols) on the repeats, one with memory drives that loss towards 0.
"""

from __future__ import annotations

import torch


def repeat_block_stream(n_blocks: int, block: int = 24, filler: int = 40, n_symbols: int = 16,
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (tokens [n_blocks * (2*block + filler)], is_repeat bool of the same length)."""
    if min(n_blocks, block, n_symbols) <= 0 or filler < 0:
        raise ValueError("n_blocks, block and n_symbols must be > 0 and filler >= 0")
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, n_symbols, (n_blocks, block), generator=g)
    fill = torch.randint(0, n_symbols, (n_blocks, filler), generator=g)
    tokens = torch.cat([first, fill, first], dim=1).reshape(-1)
    repeat = torch.zeros(n_blocks, 2 * block + filler, dtype=torch.bool)
    repeat[:, block + filler:] = True
    return tokens, repeat.reshape(-1)


def contiguous_streams(tokens: torch.Tensor, n_streams: int) -> torch.Tensor:
    """Cut one sequence into n_streams contiguous rows [n_streams, len // n_streams]
    (the layout of the Transformer-XL code's LMOrderedIterator; README.md "Data: shards and
    ordered streams"); the tail that does not fill a row is dropped."""
    per = tokens.shape[0] // n_streams
    if per == 0:
        raise ValueError(f"{tokens.shape[0]} tokens cannot fill {n_streams} streams")
    return tokens[: per * n_streams].view(n_streams, per)


def write_repeat_corpus(out_dir, *, block: int = 12, filler: int = 4, n_symbols: int = 16,
                        split_tokens: dict | None = None, seed: int = 0,
                        chunk_tokens: int = 1 << 16):
    """Write a repeat-block corpus as shards + manifest (train/valid/test from different
    seeds), so that a run needs no download. Returns the manifest."""
    from pathlib import Path

    from .shard_writer import write_manifest, write_token_split
    from .shards import Manifest, id_dtype
    from .vocab import fingerprint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = split_tokens or {"train": 400_000, "valid": 40_000, "test": 40_000}
    dtype = id_dtype(n_symbols)
    period = 2 * block + filler
    splits = {}
    for i, (split, n_tokens) in enumerate(sizes.items()):
        tokens, _ = repeat_block_stream(-(-n_tokens // period), block=block, filler=filler,
                                        n_symbols=n_symbols, seed=seed * 1000 + i)
        ids = tokens[:n_tokens].numpy().astype(dtype)
        splits[split] = write_token_split(out, split, [ids], dtype, chunk_tokens, 64)
    vocab = {"kind": "synthetic", "generator": "repeat_blocks", "size": n_symbols,
             "block": block, "filler": filler}
    manifest = Manifest(kind="tokens", source="repeat_blocks", vocab=vocab,
                        vocab_fingerprint=fingerprint(vocab), vocab_size=n_symbols,
                        dtype=str(dtype), chunk_tokens=chunk_tokens, splits=splits,
                        extra={"seed": seed, "period": period})
    write_manifest(out, manifest)
    manifest.location = str(out)
    return manifest
