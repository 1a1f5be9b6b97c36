"""The answer labels of each task, as BABILong scores them (Kuratov et al. 2024; the
authors' evaluation code, TASK_LABELS in babilong/metrics.py of github.com/booydar/babilong):
an output is right when, of these labels, it names the target and no other label beyond
those the question names (evaluation/babilong_score.py). They are the answers the original
bAbI tasks can have (Weston et al. 2015, §3): the six rooms for qa1-qa4, for qa5 its four
people and three objects, and so on for all twenty tasks. data_pipeline/babilong/babi.py
generates qa1-qa5 and answers with exactly these spellings; tests/test_babilong_babi.py checks
that every label occurs as an answer. qa6-qa20 come only from the published files
(`memtrain tasks babilong --official`).

A target is one label, or (qa8, "apple,milk") several labels joined by commas: the answer
must then name exactly those (`target_labels`). qa19's labels are themselves comma-joined
pairs of directions ("n,e"), each one label.
"""

from __future__ import annotations

from collections.abc import Iterable

_ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
_YES_NO = ("no", "yes")

# The sets of the authors' metrics.py TASK_LABELS, as sorted tuples.
TASK_LABELS: dict[str, tuple[str, ...]] = {
    "qa1": _ROOMS,
    "qa2": _ROOMS,
    "qa3": _ROOMS,
    "qa4": _ROOMS,
    "qa5": ("Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"),
    "qa6": _YES_NO,
    "qa7": ("none", "one", "three", "two"),
    "qa8": ("apple", "football", "milk", "nothing"),
    "qa9": _YES_NO,
    "qa10": ("maybe", "no", "yes"),
    "qa11": _ROOMS,
    "qa12": _ROOMS,
    "qa13": _ROOMS,
    "qa14": ("bedroom", "cinema", "kitchen", "office", "park", "school"),
    "qa15": ("cat", "mouse", "sheep", "wolf"),
    "qa16": ("gray", "green", "white", "yellow"),
    "qa17": _YES_NO,
    "qa18": _YES_NO,
    "qa19": ("e,e", "e,n", "e,s", "n,e", "n,n", "n,w", "s,e", "s,s", "s,w", "w,n", "w,s",
             "w,w"),
    "qa20": ("bedroom", "bored", "garden", "hungry", "kitchen", "thirsty", "tired"),
}


def target_labels(target: str, labels: Iterable[str]) -> frozenset[str]:
    """The labels (lower-case) an answer to `target` must name: the target itself when it is
    a label, else its comma-separated parts when each is one (qa8 "apple,milk" -> {"apple",
    "milk"}; qa19's "n,e" is a label of its own). The authors' code splits a target at
    commas when it is longer than 3 characters, which gives the same on every published
    target. Raises ValueError for a target that is neither (another task's labels?)."""
    label_set = {label.lower() for label in labels}
    wanted = target.strip().lower()
    if wanted in label_set:
        return frozenset({wanted})
    parts = {part.strip() for part in wanted.split(",")}
    if "," in wanted and parts <= label_set:
        return frozenset(parts)
    raise ValueError(f"target {target!r} is not one of the task's labels {sorted(label_set)} "
                     "nor labels joined by commas (labels of another task?)")
