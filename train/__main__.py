"""`python -m train`: what launchers (deepspeed, torchrun, srun) start on every rank; the same
options as `memtrain train`."""

import sys
from pathlib import Path

if not __package__:
    # Run as a file (DeepSpeed's slurm launcher runs a script path and ignores --module):
    # import the package from the checkout, not this folder's modules as top-level names.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from train.cli import main_train  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_train(sys.argv[1:]))
