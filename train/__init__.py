"""train/: composes model/ and data_pipeline/ into runs (engine, BPTT, checkpoints, tracking,
the run directory, and the evaluation the loop runs between steps).

Reading order, following one run (`memtrain train` -> cli.py):
    config.py       the typed run config (RunConfig), YAML + `section.field=value` overrides
    shipped.py      the run configs shipped in configs/ (`--config quickstart`), found from
                    a checkout and from an installed wheel alike
    trainer.py      setup on each rank: process group, data, engine, resume, tracker
    loop.py         TrainingLoop: micro-steps -> optimizer steps, the step's one host sync,
                    logging, validation, checkpoints, stop signals
    bptt.py         one micro-step's BPTT window: segments, memory threading, one backward
    engine.py       DeepSpeed: ds_config, optimizer groups, LR schedule
Around the loop:
    distributed.py  rank / world / master from whichever launcher started us;
                    gpu_binding.py, the rank's GPU; deepspeed_setup.py, importing
                    DeepSpeed and its ops; process_group.py, the collectives
    checkpoint.py, resume.py, export.py   save, load (also on another world size), safetensors
    run_dir.py      every file a run directory keeps; tracking.py, loss_curve.py, progress.py
    evaluate.py     scoring under a stated protocol (valid during training, the final report)
    regime.py       the data regime (token stream or task samples), decided once from the
                    manifest: the stream, window plan, curriculum and evaluation loop it gives
    curriculum.py   the segment-count curriculum for task data
Before a run: smoke.py (`memtrain smoke`, plain PyTorch). After it: run_access.py, what
evaluation/ reads a run through. `memtrain plan`, the GPU-memory planner, is planner/: it
reads config.py, engine.py and regime.py, and train/ never imports it; memory_probe.py
measures what one BPTT window allocates, the plan's ground truth (tests,
benchmarks/bench_memory_plan.py).

Never imports evaluation/, compare/ or cluster/ (tests/test_package_layout.py).
"""
