"""model/mechanisms/: one module per memory mechanism, and the registry that names them.

    registry.py  `Mechanism` (what every mechanism states), `register`, `get`
    xl.py        Transformer-XL (Dai et al. 2019): the per-layer cache
    lamemo.py    LaMemo (Ji et al. 2022): the look-ahead memory
    rmt.py       Recurrent Memory Transformer (Bulatov et al. 2022): memory tokens
    armt.py      Associative RMT (Rodkin et al. 2024): memory tokens writing associative
                 matrices
    titans.py    Titans (Behrouz et al. 2025): a neural memory per layer, an MLP trained
                 inside the forward pass, read as a context (MAC)

Each module holds its options section and validation, its traits, and how it runs on the
native stack and around a pretrained decoder; the numerics of the native forwards live in
the modules they name (model/transformer_xl.py, lamemo.py, rmt.py, armt.py, titans.py). A new
mechanism is one module and one line in `registry._builtins` (docs/mechanisms.md).
"""

from .registry import Mechanism, get, names, register, sections, unregister

__all__ = ["Mechanism", "get", "names", "register", "sections", "unregister"]
