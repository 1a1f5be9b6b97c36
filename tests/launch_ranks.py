"""The tests' launcher of N local ranks: what torchrun gives a single-node job (the rank
variables, one process per rank, a failure of one rank ending the others), without
importing torch. torchrun's own start costs about 1.75 CPU seconds a launch (it imports
torch to run an elastic agent the tests never use). It serves every test that trains on
several ranks (`train_helpers.run_train` and `train_cmd` by default, the SIGKILL and signal
tests, the probes); the tests that check torchrun itself (its exit-code report, c10d
rendezvous, the multi-node rehearsal) and the deepspeed launcher name theirs.

    python tests/launch_ranks.py NPROC MASTER_PORT python-args...

Each rank runs `sys.executable python-args...` with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (and OMP_NUM_THREADS=1 unless set, as
torchrun does for more than one rank), in the launcher's process group, stdout and stderr
shared. SIGTERM and SIGINT are passed on to every rank. Exit: 0 if every rank
returned 0; else the first failing rank's code (a rank killed by a signal: 128 + signal),
the other ranks sent SIGTERM first, as torchrun does.
"""

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    nproc, port, args = int(argv[0]), argv[1], argv[2:]
    ranks = []
    for rank in range(nproc):
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, *args], env=env))

    def pass_on(sig, _frame):
        for proc in ranks:
            if proc.poll() is None:
                proc.send_signal(sig)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            pass_on(signal.SIGTERM, None)
            for proc in ranks:
                proc.wait()
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
