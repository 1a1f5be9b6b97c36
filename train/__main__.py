"""`python -m train`: what launchers (deepspeed, torchrun, srun) start on every rank; the same
options as `memtrain train`."""

import sys

from train.cli import main_train

if __name__ == "__main__":
    sys.exit(main_train(sys.argv[1:]))
