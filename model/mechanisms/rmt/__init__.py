"""Recurrent Memory Transformer (Bulatov et al. 2022): memory tokens read and written by
the segment.

mechanism.py: its options, validation, traits and segment around a pretrained decoder
core.py: the native forward and the paper's attention rule
"""
