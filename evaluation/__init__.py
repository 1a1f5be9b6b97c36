"""Tools on a trained run, built on train/ (which never imports them): `memtrain eval` (cli)
with its memory-length sweep (sweep) and BABILong table (babilong_report), whose files and
MLflow logging are eval_files; RECL (recl, recl_cli), cached vs vanilla speed (speed),
memory plots (memory_plots, analyze_cli) and sampling (generate_cli). The protocols and the
scoring they share with the training loop are train/evaluate.py; a run's config, checkpoint
and MLflow run are reached through train/run_access.py."""
