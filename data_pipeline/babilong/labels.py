"""The answer labels of each task, as BABILong scores them (Kuratov et al. 2024; the
authors' evaluation code, babilong/metrics.py in github.com/booydar/babilong): an output is
right when, of these labels, it names the target and no other label beyond those the
question names (evaluation/babilong_score.py). They are the answers the original bAbI
tasks can have (Weston et al. 2015, §3): the six rooms for qa1-qa4, and for qa5 its four
people and three objects. data_pipeline/babilong/babi.py answers with exactly these
spellings; tests/test_babilong_babi.py checks that every label occurs as an answer.
"""

from __future__ import annotations

_ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")

TASK_LABELS: dict[str, tuple[str, ...]] = {
    "qa1": _ROOMS,
    "qa2": _ROOMS,
    "qa3": _ROOMS,
    "qa4": _ROOMS,
    "qa5": ("Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"),
}
