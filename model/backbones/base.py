"""The backbone interface: everything the house asks of a backbone, asked the same way of
the native stack (native.py) and of a pretrained Hugging Face model (pretrained.py).

A backbone is looked up by `model.backbone` in the registry (model/backbones/__init__.py)
and asked; no caller branches on its name. What the model config itself must know of it to
validate (its XL cache, its memory and positions, whether its shape comes from a checkpoint)
is its `traits` entry in model/config.py, under the same name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from ..config import BACKBONE_TRAITS, BackboneTraits, ConfigError


@dataclass(frozen=True)
class FlopCounts:
    """What a step's FLOP estimate needs of a model besides its segment's shapes
    (train/throughput.py): the weights every row passes through (the decoder stack and what
    the mechanism adds), the head's weights every scored token passes through, and the
    share of all weights that train."""

    n_body: int
    n_head: int
    trained_share: float


class Backbone(ABC):
    """The defaults are the native stack's answers where there is a natural one; the
    abstract methods have none, and a backbone that leaves one out cannot be instantiated."""

    name: ClassVar[str]
    # Its weights start from a checkpoint that one device need not hold: at ZeRO-3 train/
    # loads it partitioned (train/pretrained.py), and the final report of a half-precision
    # run does not gather its fp32 masters whole (train/master_weights.py).
    loads_checkpoint: ClassVar[bool] = False
    # `memtrain analyze` records attention maps and memory through the native stack's hooks
    # (evaluation/analysis.py); a backbone without them is refused by name.
    records_analysis: ClassVar[bool] = False

    @property
    def traits(self) -> BackboneTraits:
        return BACKBONE_TRAITS[self.name]

    # ------------------------------------------------------------------ the config
    def resolve_shape(self, cfg):
        """Read the shape fields of `cfg` from wherever they come from, in place; returns
        `cfg`. The native stack's are its config's own: nothing to read."""
        return cfg

    def require_shape(self, cfg, what: str) -> None:
        """A ConfigError naming the missing step when `what` needs a shape not read yet."""
        return None   # the native stack's shape is its config's own: always read

    def label(self, cfg) -> str:
        """What `memtrain plan` calls the model in its first line."""
        return cfg.mechanism

    def finetune(self, cfg) -> str:
        """Which of its weights train: "full" (all), "frozen" (none: only the memory) or
        "lora" (low-rank adapters and the memory)."""
        return "full"

    def checkpoint_source(self, cfg) -> tuple[str, str] | None:
        """(config field, value) of the pretrained checkpoint a job reads, a local directory
        or a hub name (what `memtrain submit` pins or notes before sbatch); None: none."""
        return None

    # ------------------------------------------------------------------ the model
    @abstractmethod
    def build(self, cfg, **kwargs):
        """The SegmentLM (model/segment_lm.py) of `cfg`, its shape read."""

    @abstractmethod
    def shape_class(self, cfg):
        """What states a segment's shapes for the planner (`segment_shapes`, model/shapes.py;
        optionally `parameter_counts`)."""

    # ------------------------------------------------------------------ the weights
    def exported_names(self, model) -> list[str] | None:
        """The parameter names an export of `model` holds; None: its whole state dict."""
        return None

    def export_metadata(self, cfg) -> dict[str, str]:
        """Metadata an export carries beyond the model config (model/io.py)."""
        return {}

    @abstractmethod
    def write_weights(self, model, filename: str, metadata: dict[str, str]) -> None:
        """Write the export's tensors to the safetensors file `filename`."""

    @abstractmethod
    def load_weights(self, model, path: str, device) -> None:
        """Load an export written by `write_weights` into `model` (built from its config),
        strictly."""

    @abstractmethod
    def load_state(self, model, state: dict, source: str) -> None:
        """Load a consolidated training checkpoint's fp32 state (train/export.py) into
        `model`: what its export holds, strictly (ValueError naming `source`)."""

    # ------------------------------------------------------------------ the data
    def fits_vocabulary(self, cfg, n_ids: int) -> bool:
        """Whether a trained model reads data of `n_ids` ids: the native stack's softmax is
        its data's vocabulary, exactly."""
        return n_ids == cfg.vocab_size

    def check_training_data(self, cfg, manifest, data_path: str, announce: bool) -> None:
        """Refuse (ConfigError) data `cfg` cannot be trained on: ids past its embedding."""
        if manifest.vocab_size > cfg.vocab_size:
            raise ConfigError("model.vocab_size", f"{cfg.vocab_size} is smaller than the "
                              f"data's vocabulary ({manifest.vocab_size} ids in {data_path})")

    # ------------------------------------------------------------------ positions
    def check_segment_positions(self, cfg, seg_len: int, option: str) -> None:
        """Refuse (ConfigError naming `option`) a segment length the backbone cannot place;
        relative positions place any."""
        return None   # the native stack's relative positions place any length

    @abstractmethod
    def flop_counts(self, cfg) -> FlopCounts:
        """`FlopCounts` of `cfg`, counted without weights (the meta device, a checkpoint's
        config) and without drawing from the random stream."""

    def flop_terms(self, cfg, seg_len: int) -> tuple[float, float, int]:
        """What the FLOP estimate (train/throughput.py) reads of one segment of `seg_len`
        tokens of one batch row with a full memory: (R, the rows through a layer, mean over
        layers; the sum over every attention call of d_attn x Q x K; the scored rows beyond
        the segment's tokens), from the shapes the segment states (model/shapes.py)."""
        import dataclasses

        c = dataclasses.replace(cfg, tgt_len=seg_len)
        sh = self.shape_class(c).segment_shapes(c, 1, c.mem_len)
        rows, attention = 0, 0
        for layer in sh.layers:
            if hasattr(layer, "blocks"):        # a stated layer (a pretrained decoder's)
                rows += layer.input_rows
                attention += sum(a.queries * a.keys * a.heads * a.head_dim
                                 for blk in layer.blocks for a in blk.attention)
            else:
                rows += layer.out_rows
                attention += sum(a.queries * a.keys for a in layer.attention) * \
                    c.n_head * c.d_head
        return rows / len(sh.layers), attention, sh.aux_targets
