"""model/mechanisms/: one folder per memory mechanism, each holding all of it.

    xl/       Transformer-XL (Dai et al. 2019): the per-layer cache
    lamemo/   LaMemo (Ji et al. 2022): the look-ahead memory
    rmt/      Recurrent Memory Transformer (Bulatov et al. 2022): memory tokens
    armt/     Associative RMT (Rodkin et al. 2024): memory tokens writing associative
              matrices (associative.py: the read and the delta-rule write)
    titans/   Titans (Behrouz et al. 2025): a neural memory per layer, an MLP trained
              inside the forward pass (neural_memory.py: the memory and its update)

In each folder, mechanism.py is the registry entry: its options section and validation,
its traits, its segment around a pretrained decoder; core.py its native forward. The
registry that names them is model/registry.py, one floor down. A new mechanism is one
folder and one line in `registry._MODULES` (docs/mechanisms.md).
"""
