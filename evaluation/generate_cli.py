"""`memtrain generate`: sample from a trained model, streaming, with the memory carried.

    memtrain generate --checkpoint runs/enwik8-xl-base --prompt "The memory of" \\
        --max-new-tokens 2000 --temperature 0.8 --top-p 0.95

--checkpoint is a run directory (its latest checkpoint), one checkpoint folder of a run
(runs/x/checkpoints/step00001000) or an exported model.safetensors. The text goes through the
vocabulary of the run's data manifest (`--data` for an exported file). Sampling is
model.generate.stream_generate: the memory advances once per segment (`--seg-len`, by default
the trained tgt_len) exactly as in training and evaluation, so any length costs O(length) and
the model sees the context it was scored with. Tokens print as they are sampled.

The model and its vocabulary come from evaluation/generation.py (`load_for_generation`),
which also fits the model to the data's ids.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import os
import sys
from pathlib import Path

import torch

from memtrain.command_line import error_line
from model import ConfigError, stream_generate
from model.backbones import check_segment_positions
from model.io import read_config

from .generation import load_for_generation

DECODE_WINDOW = 16  # tokens re-decoded to print a suffix (multi-token characters and words)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="run dir, checkpoint folder, or exported .safetensors")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the run's vocabulary)")
    src.add_argument("--prompt-ids", help="prompt as token ids, e.g. '3 1 4 1 5'")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-len", type=int, default=-1, help="memory length (default: trained)")
    p.add_argument("--seg-len", type=int, default=0,
                   help="segment length the memory advances by (default: trained tgt_len)")
    p.add_argument("--data", help="data manifest folder (for an exported .safetensors)")
    p.add_argument("--ids", action="store_true", help="print token ids instead of text")
    return p


class StreamingDecoder:
    """Turns sampled ids into printable text as they come. Byte-level vocabularies go
    through an incremental UTF-8 decoder (a character may span several tokens); others
    print the new suffix of a decoded window of the last tokens."""

    def __init__(self, vocab, as_ids: bool):
        self.vocab, self.as_ids, self.ids = vocab, as_ids or vocab is None, []
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") \
            if hasattr(vocab, "decode_bytes") and getattr(vocab, "unit", "bytes") == "bytes" \
            else None

    def push(self, token: int) -> str:
        if self.as_ids:
            return f"{token} "
        if self.utf8 is not None:
            return self.utf8.decode(self.vocab.decode_bytes([token]))
        self.ids.append(token)
        window = self.ids[-DECODE_WINDOW - 1:]          # the same start before and after
        before, after = self.vocab.decode(window[:-1]), self.vocab.decode(window)
        return after[len(os.path.commonprefix([before, after])):]

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True) if self.utf8 is not None else ""


def _checked_checkpoint(name: str) -> Path:
    """--checkpoint as given, refusing a path that is not there or a file that is not a
    memtrain model file by what it is (a file under any other name than .safetensors
    would otherwise be looked for as a run directory)."""
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint {name}: no such run directory, checkpoint "
                                "folder or model file")
    if path.is_file():
        read_config(path)        # a WeightsError naming what the file is not
        if path.suffix != ".safetensors":
            raise ValueError(f"--checkpoint {name}: a memtrain model file is read by its "
                             "name ending .safetensors; rename it")
    return path


def _no_vocabulary(checkpoint: Path, data: str | None) -> str:
    """Why --prompt cannot be encoded, and what to give instead."""
    if data is None and checkpoint.suffix == ".safetensors":
        # A model file (an export, or what `memtrain import` wrote) carries no vocabulary:
        # the text's tokens come from the data it was trained or is run on.
        return (f"{checkpoint} carries no vocabulary: give --data, the data manifest folder "
                "tokenized for this model (its text vocabulary encodes the prompt), or "
                "--prompt-ids")
    return (f"the data {data or 'of this run'} has no text vocabulary (ids only); give "
            "--prompt-ids")


def main_generate(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for name in ("max_new_tokens", "top_k"):
            if getattr(args, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')}", "must be >= 0")
        if args.temperature <= 0 or not 0 < args.top_p <= 1:
            raise ConfigError("--temperature/--top-p", "need temperature > 0, 0 < top-p <= 1")
        checkpoint = _checked_checkpoint(args.checkpoint)
        # DeepSpeed's checkpoint consolidation prints progress: keep stdout for the text.
        with contextlib.redirect_stdout(sys.stderr):
            model, vocab = load_for_generation(checkpoint, args.data)
        if args.prompt is not None:
            if vocab is None:
                raise ConfigError("--prompt", _no_vocabulary(checkpoint, args.data))
            ids = [int(i) for i in vocab.encode(args.prompt)]
        else:
            ids = [int(x) for x in args.prompt_ids.replace(",", " ").split()]
        if not ids:
            raise ConfigError("--prompt", "is empty")
        bad = [i for i in ids if not 0 <= i < model.cfg.vocab_size]
        if bad:
            raise ConfigError("--prompt-ids", f"ids {bad[:5]} outside [0, "
                              f"{model.cfg.vocab_size})")
        if args.mem_len >= 0:
            model.set_lengths(mem_len=args.mem_len)
        if args.seg_len < 0:
            raise ConfigError("--seg-len", "must be >= 1 (or 0: the trained tgt_len)")
        seg_len = args.seg_len or model.cfg.tgt_len
        check_segment_positions(model.cfg, seg_len, "--seg-len")
    except (ConfigError, FileNotFoundError, ValueError) as err:
        return error_line("memtrain generate", err, code=2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.tensor([ids], device=device)
    out = StreamingDecoder(vocab, args.ids)
    for token in stream_generate(model, prompt, args.max_new_tokens,
                                 temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seg_len=seg_len, generator=gen):
        sys.stdout.write(out.push(int(token[0])))
        sys.stdout.flush()
    sys.stdout.write(out.flush() + "\n")
    return 0
