"""Weight decay reaches only weight matrices (the usual practice), never LayerNorm gains,
biases, the u/v position biases or RMT's initial memory."""

from reference import tiny_model

from train.config import load_config
from train.engine import build_optimizer


def test_weight_decay_skips_layer_norms_biases_and_memory_vectors():
    cfg = load_config("quickstart", ["optim.weight_decay=0.1", "optim.name=adamw"])
    model = tiny_model("rmt")
    opt = build_optimizer(model, cfg)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    names = {name: id(p) in decay for name, p in model.named_parameters()}
    assert len(decay) + sum(len(g["params"]) for g in opt.param_groups
                            if g["weight_decay"] == 0.0) == len(names)
    assert not any(v for n, v in names.items() if "layer_norm" in n or n.endswith(".bias"))
    assert not names["core.memory_init.value"] and not names["core.rel_u.value"]
    assert names["core.layers.0.attn.q_net.weight"] and names["core.layers.0.ff.core.0.weight"]
