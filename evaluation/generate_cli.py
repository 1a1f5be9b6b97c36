"""`memtrain generate`: sample from a trained model, streaming, with the memory carried.

    memtrain generate --checkpoint runs/enwik8-xl-base --prompt "The memory of" \\
        --max-new-tokens 2000 --temperature 0.8 --top-p 0.95

--checkpoint is a run directory (its latest checkpoint), one checkpoint folder of a run
(runs/x/checkpoints/step00001000) or an exported model.safetensors. The text goes through the
vocabulary of the run's data manifest (`--data` for an exported file). Sampling is
model.generate.stream_generate: the memory advances once per segment (`--seg-len`, by default
the trained tgt_len) exactly as in training and evaluation, so any length costs O(length) and
the model sees the context it was scored with. Tokens print as they are sampled.

A pretrained backbone (`model.backbone: hf`) may have more output rows than the data has ids
(an embedding padded past its tokenizer, or a small task alphabet): the data's ids must fit
the model, and sampling draws from the data's ids only (the others never occurred in
training and the vocabulary cannot print them).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import os
import sys
from pathlib import Path

import torch

from data_pipeline.shards import load_manifest
from data_pipeline.vocabs import vocab_from_dict
from memtrain.command_line import error_line
from model import ConfigError, load_model, stream_generate
from model.open_segment import open_segment
from model.pretrained.checkpoint_config import check_segment_positions
from train.checkpoint import MARKER
from train.export import load_weights
from train.run_access import load_run_config, pick_checkpoint
from train.run_dir import RunDir

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


def load_for_generation(path: Path, data: str | None):
    """(model, vocabulary or None) from a run dir, a checkpoint folder or a .safetensors."""
    if path.suffix == ".safetensors":
        model, data_path = load_model(path), data
    else:
        run_dir, name = path, None
        if (path / MARKER).is_file() and path.parent.name == RunDir.CHECKPOINTS:
            run_dir, name = path.parent.parent, path.name
        cfg = load_run_config(str(run_dir), [])
        info = pick_checkpoint(cfg, name)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint in {run_dir}")
        model, data_path = load_weights(info, cfg.model), data or cfg.data.path
    vocab = None
    if data_path:
        manifest = load_manifest(data_path)
        # Training accepts data whose ids fit the model (train/trainer.py); a native model
        # has exactly the data's vocabulary, a pretrained one its checkpoint's.
        if manifest.vocab_size > model.cfg.vocab_size or (
                model.cfg.backbone != "hf" and manifest.vocab_size != model.cfg.vocab_size):
            raise ConfigError("model.vocab_size", f"the model has {model.cfg.vocab_size} "
                              f"ids but the data at {data_path} has {manifest.vocab_size}")
        if manifest.vocab_size < model.cfg.vocab_size:
            model = DataIds(model, manifest.vocab_size)
        try:
            vocab = vocab_from_dict(manifest.vocab)
        except (ValueError, KeyError):
            vocab = None  # e.g. a synthetic stream: ids only
    return model, vocab


class DataIds(torch.nn.Module):
    """`model` sampling only ids below `n_ids`: the others get probability 0 (every other
    call passes through unchanged)."""

    def __init__(self, model, n_ids: int):
        super().__init__()
        self.model, self.n_ids, self.cfg = model, n_ids, model.cfg

    def initial_state(self, batch_size: int, device=None):
        return self.model.initial_state(batch_size, device)

    def set_lengths(self, **lengths) -> None:
        self.model.set_lengths(**lengths)

    def forward(self, tokens, state=None, **kwargs):
        out = self.model(tokens, state, **kwargs)
        if out.log_probs is not None:
            out.log_probs[..., self.n_ids:] = float("-inf")
        return out

    def open_segment(self, state):
        """The model's own open segment of a generation (model/open_segment.py: a
        pretrained backbone's is KV-cached), its predictions limited to the data's ids."""
        return DataIdsSegment(open_segment(self.model, state), self.n_ids)


class DataIdsSegment:
    """An open segment (model/open_segment.py) whose predictions give the ids from `n_ids`
    on probability 0."""

    def __init__(self, segment, n_ids: int):
        self.segment, self.n_ids = segment, n_ids

    def read(self, tokens) -> None:
        self.segment.read(tokens)

    def predict(self, tokens) -> torch.Tensor:
        log_probs = self.segment.predict(tokens)
        log_probs[..., self.n_ids:] = float("-inf")
        return log_probs

    def commit(self):
        return self.segment.commit()


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


def main_generate(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for name in ("max_new_tokens", "top_k"):
            if getattr(args, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')}", "must be >= 0")
        if args.temperature <= 0 or not 0 < args.top_p <= 1:
            raise ConfigError("--temperature/--top-p", "need temperature > 0, 0 < top-p <= 1")
        # DeepSpeed's checkpoint consolidation prints progress: keep stdout for the text.
        with contextlib.redirect_stdout(sys.stderr):
            model, vocab = load_for_generation(Path(args.checkpoint), args.data)
        if args.prompt is not None:
            if vocab is None:
                raise ConfigError("--prompt", "this model's data has no text vocabulary; "
                                  "give --prompt-ids")
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
