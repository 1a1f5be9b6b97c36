"""memtrain: training memory-augmented language models (Transformer-XL, LaMemo, RMT, ARMT)."""

__version__ = "0.1.0"
