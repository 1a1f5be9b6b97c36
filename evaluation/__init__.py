"""Evaluation of trained runs: protocols and scoring (evaluate), `memtrain eval` (cli) with its
memory-length sweep (sweep), RECL (recl, recl_cli), cached vs vanilla speed (speed), memory
plots (memory_plots, analyze_cli) and sampling (generate_cli)."""
