"""LaMemo (Ji et al. 2022): the look-ahead memory that refreshes the cache.

mechanism.py: its options, validation and traits
core.py: the native forward
"""
