"""What a loaded pretrained causal LM does, checked once at load on a short input against
its own forward, so that an architecture is taken by what it is, not by name (traits.py
says what its config tells).

On two rows of PROBE_TOKENS token ids, in eval mode and without gradients (first the
decoder must run on embeddings that are not a token's, as memory rows are: Gemma 4 looks
its per-layer embeddings up from token ids and refuses other rows):

1. attention: the decoder stack on the token embeddings under memtrain's causal attention
   with explicit default position ids (positions.py `causal_attention`: what ARMT, Titans
   and RMT's "causal" pattern run) equals the decoder's own forward with no mask and no
   positions. A model whose attention does not dispatch through transformers' attention
   functions is given a 4-D mask instead (`attention = "mask"`); if neither path gives
   the model's own output it is refused.
2. positions: the same rows at position ids shifted by 2, and at twice the spacing. A
   learned table moves with a shift ("absolute"), rotary positions do not (relative) but
   do with the spacing, and a model that reads neither ("sequence": ALiBi, or none) is
   refused (traits.py says why).
3. logits: the head on the decoder's output, then the post-processing the config names
   (each operation a config field may stand for is tried), equals the model's forward on
   the token ids: this also checks an embedding normaliser (Gemma multiplies by
   sqrt(d_model) inside its embedding module, so token ids and the wrapper's
   `get_input_embeddings()(ids)` get it alike, and memory rows, which are not tokens,
   do not, as in the base model's forward on `inputs_embeds`).
4. loss: the forward's own training loss with the ids as labels equals the cross-entropy
   of those logits plus, for a mixture-of-experts model whose config asks for it, the
   weighted load-balancing loss router.py computes from the routers' recorded logits.

Skipped where the weights hold no values (a ZeRO-3 partitioned load, a model on the meta
device): the config's traits stand. The result is kept on the base module
(`memtrain_traits`, which copies of the module keep) for `lm_logits` and
`causal_attention`.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from ..typed import ConfigError
from .logits import post_process
from .positions import causal_attention
from .router import find_router
from .traits import (
    ATTR,
    LOGITS_FIELDS,
    Traits,
    logits_fields,
    logits_steps,
    refuse_sequence_positions,
    static_traits,
)

PROBE_TOKENS = 6
# The compared paths run the same modules on the same input, so they agree to the last bit
# in practice; the tolerance only absorbs kernel choices (a different fused path for one of
# them), far below any rescaling of the logits or any move of a learned position table.
_RTOL = 1e-3
# Relative positions are shift-invariant up to the rounding of cos and sin.
_SHIFT_RTOL = 1e-4


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


@torch.no_grad()
def probe(base) -> Traits:
    """Check `base` (module docstring) and keep its traits on it; a ConfigError on
    model.hf.path naming the property where memory tokens cannot be placed in it."""
    traits = static_traits(base)
    setattr(base, ATTR, traits)
    if base.base_model is base:
        # The mechanisms run `base.base_model` as the decoder stack, the head apart.
        raise ConfigError("model.hf.path", f"{traits.model_type!r}: {type(base).__name__} "
                          f"names no decoder module apart from its head (its base_model is "
                          f"the causal LM itself), which the memory runs on its own")
    weight = base.get_input_embeddings().weight
    if weight.numel() == 0 or weight.is_meta:
        return traits
    n = PROBE_TOKENS
    # Two rows (a mask the model checks against the batch shows), different tokens.
    ids = torch.stack([torch.arange(n, device=weight.device),
                       torch.arange(n, 0, -1, device=weight.device)]) % base.config.vocab_size
    was_training = base.training
    base.eval()
    try:
        emb = base.get_input_embeddings()(ids)
        router = find_router(base, traits.moe)
        routed, own = _own(base, traits, emb, router)
        traits = _check_attention(base, traits, emb, own)
        traits = _check_positions(base, traits, emb, own)
        traits = _check_logits(base, traits, ids, own)
        setattr(base, ATTR, traits)
        _check_loss(base, traits, ids, own, router, routed)
    finally:
        base.train(was_training)
    traits = dataclasses.replace(traits, checked=True)
    setattr(base, ATTR, traits)
    return traits


def _own(base, traits: Traits, emb, router) -> tuple[list, torch.Tensor]:
    """The decoder's own forward on the token embeddings (and its routers' logits); then a
    run with one row that is no token's embedding, as a memory row is."""
    routed: list = []
    if router is None:
        own = base.base_model(inputs_embeds=emb, use_cache=False)[0]
    else:
        with router.routed() as routed:
            own = base.base_model(inputs_embeds=emb, use_cache=False)[0]
    try:
        base.base_model(inputs_embeds=torch.cat([emb[:, :1] * 0.5, emb[:, 1:]], 1),
                        use_cache=False)
    except (TypeError, ValueError, RuntimeError) as err:
        # e.g. Gemma 4's per-layer embeddings, looked up from token ids beside them
        raise ConfigError("model.hf.path", f"{traits.model_type!r}: its decoder does not run "
                          f"on input embeddings alone, as memory rows (which have no token "
                          f"ids) need: {str(err).splitlines()[0][:200]}") from None
    return routed, own


def _run(base, emb: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with causal_attention(base, emb.shape[1], emb.dtype, emb.device) as mask:
        return base.base_model(inputs_embeds=emb, attention_mask=mask,
                               position_ids=positions.expand(emb.shape[0], -1),
                               use_cache=False)[0]


def _check_attention(base, traits: Traits, emb, own) -> Traits:
    scale = float(own.abs().max())
    tried = []
    for mode in dict.fromkeys((traits.attention, "mask")):
        setattr(base, ATTR, dataclasses.replace(traits, attention=mode))
        try:
            gap = _gap(_run(base, emb, torch.arange(emb.shape[1], device=emb.device)), own)
        except (TypeError, ValueError, RuntimeError) as err:
            tried.append(f"{mode}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        if gap <= _RTOL * scale:
            return dataclasses.replace(traits, attention=mode)
        tried.append(f"{mode}: differs by up to {gap:.3g}")
    raise ConfigError("model.hf.path", f"{traits.model_type!r}: its decoder under memtrain's "
                      f"causal attention (an explicit mask and position ids, "
                      f"model/pretrained/positions.py) does not reproduce its own forward "
                      f"({'; '.join(tried)})")


def _check_positions(base, traits: Traits, emb, own) -> Traits:
    n = emb.shape[1]
    r = torch.arange(n, device=emb.device)
    scale = float(own.abs().max())
    shifted, spaced = _gap(_run(base, emb, r + 2), own), _gap(_run(base, emb, 2 * r), own)
    if shifted == 0 and spaced == 0:
        raise refuse_sequence_positions(traits.model_type, "its forward's output does not "
                                        "change with the position ids")
    if shifted <= _SHIFT_RTOL * scale:
        return dataclasses.replace(traits, positions="rotary", table=0)
    table = int(getattr(base.config, "max_position_embeddings", 0) or 0)
    return dataclasses.replace(traits, positions="absolute", table=table)


def _check_logits(base, traits: Traits, ids, own) -> Traits:
    theirs = base(input_ids=ids, use_cache=False).logits.float()
    head = base.get_output_embeddings()(own)
    fields = logits_fields(base.config)
    best = float("inf")
    for ops in itertools.product(*(LOGITS_FIELDS[f] for f in fields)):
        steps = logits_steps(base.config, dict(zip(fields, ops, strict=True)))
        err = _gap(post_process(head, steps), theirs)
        if err <= _RTOL * float(theirs.abs().max()):
            return dataclasses.replace(traits, logits=steps)
        best = min(best, err)
    named = ", ".join(f"{f} = {getattr(base.config, f)}" for f in fields) or "none"
    raise ConfigError("model.hf.path", f"{traits.model_type!r} post-processes its logits in "
                      f"a way the wrapper does not reproduce (its forward's logits differ from "
                      f"the head's on its decoder's output by up to {best:.3g}, largest logit "
                      f"{float(theirs.abs().max()):.3g}; config fields tried: {named}), or "
                      "scales its token embeddings outside its embedding module; "
                      "model/pretrained/logits.py lists what is reproduced")


def _check_loss(base, traits: Traits, ids, own, router, routed) -> None:
    try:
        theirs = base(input_ids=ids, labels=ids, use_cache=False).loss
    except (TypeError, ValueError):     # a forward that takes no labels adds nothing
        return
    if theirs is None:
        return
    logits = post_process(base.get_output_embeddings()(own), traits.logits).float()
    ours = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    aux = router.coef * router.balance_loss(routed) if router is not None else 0.0
    gap = abs(float(ours + aux) - float(theirs))
    if gap > _RTOL * max(1.0, abs(float(theirs))):
        what = (f"the load-balancing loss of {len(routed)} router runs weighted "
                f"{router.coef}" if router is not None else "no auxiliary loss")
        raise ConfigError("model.hf.path", f"{traits.model_type!r}: its forward's training "
                          f"loss ({float(theirs):.6g}) is not the cross-entropy of its logits "
                          f"plus {what} ({float(ours + aux):.6g}): it adds a term the wrapper "
                          "does not reproduce (model/pretrained/router.py)")
