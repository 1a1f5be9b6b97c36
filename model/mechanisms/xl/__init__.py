"""Transformer-XL (Dai et al. 2019): the per-layer cache of the previous segments' hidden
states, read with relative positions.

mechanism.py: the registry entry (traits)
core.py: the native forward
"""
