"""Run by test_train_episodic.py: `python -m train` whose VALIDATION losses are scripted.

    python tests/scripted_validation.py '[2.0, 1.5, ...]' --config run.yaml

Each validation on the valid split is computed for real, then reports the next scripted
loss, so a test knows exactly which evaluations improved and can check what the plateau
schedule does with them in the real training loop. The final evaluation (eval.split) is
left untouched.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train.loop as loop  # noqa: E402
from train.cli import main_train  # noqa: E402

scripted = iter(json.loads(sys.argv[1]))
real_evaluate = loop.evaluate


def evaluate(forward, model, manifest, proto, *args, **kwargs):
    report = real_evaluate(forward, model, manifest, proto, *args, **kwargs)
    if proto.split == "valid":
        report["loss"] = next(scripted)
    return report


loop.evaluate = evaluate
sys.exit(main_train(sys.argv[2:]))
