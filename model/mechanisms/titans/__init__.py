"""Titans (Behrouz, Zhong, Mirrokni 2025): a neural memory per layer, an MLP trained inside
the forward pass.

mechanism.py: its validation, traits and segment around a pretrained decoder
options.py: its config section
core.py: the native forward (MAC, MAG, MAL)
neural_memory.py: the memory and its chunked update
pretrained.py: the hooks around a pretrained decoder's layers
"""
