"""planner/: `memtrain plan`, the per-GPU memory of a run before it is submitted.

    plan.py         the command: ZeRO model states and buffers, the carried state, one BPTT
                    window's peak, the largest bptt.depth and mem_len that fit
    activations.py  what each block of a segment saves, from the shapes each mechanism states
                    (model/shapes.py); the planner never asks which mechanism it plans
    window.py       the peak of one window, walked block by block through the backward
    recompute.py    what a checkpointed segment keeps under a selective bptt.recompute

Reads model/, data_pipeline/, and train/'s run config, ds-config rendering and data regime
(train/regime.py: the manifest's token stream or task samples, and the windows each trains
on); train/ never imports it (tests/test_package_layout.py).
"""
