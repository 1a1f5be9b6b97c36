"""Associative Recurrent Memory Transformer (Rodkin et al. 2024): memory tokens that write
one association matrix per layer.

mechanism.py: its options, validation, traits and segment around a pretrained decoder
core.py: the native forward
associative.py: the associative read and write (the delta rule)
associative_grad.py: their hand-written backward
pretrained.py: the hooks around a pretrained decoder's layers
"""
