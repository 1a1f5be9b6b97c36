"""train/: composes model/ and data_pipeline/ into runs (engine, BPTT, checkpoints, tracking,
the run directory, and the evaluation the loop runs between steps).

Never imports evaluation/, compare/ or cluster/ (tests/test_package_layout.py).
"""
