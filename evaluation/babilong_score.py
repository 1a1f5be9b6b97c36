"""BABILong's correctness rule: is a model's free-text answer the target label?

BABILong (Kuratov et al. 2024, "BABILong: Testing the Limits of LLMs with Long Context
Reasoning-in-a-Haystack", NeurIPS 2024 Datasets and Benchmarks, arXiv:2406.10149) scores
generated text, not a forced choice: accuracy per task x length is the fraction of samples
whose output passes this rule. The paper reports the accuracies; the rule itself is defined
by the authors' evaluation code (github.com/booydar/babilong, babilong/metrics.py), which the
published tables were computed with. What it does, and so what this module does:

1. Only the first sentence counts: the output up to its first "." (a model that answers
   and then goes on, "The milk is in the office. Before that it was in the hallway.", is
   judged on "The milk is in the office"). The text is also cut at "<context>" and
   "<example>", where a model starts repeating the prompt's scaffolding.
2. Case is ignored (everything is lower-cased).
3. Only the task's answer labels are looked for (for qa1-qa4 the six rooms; for qa5 the
   four people and three objects; every task's in data_pipeline/babilong/labels.py): the
   output may say anything else around them.
4. A label that appears in the question is ignored in the output: "Where was the football
   before the kitchen?" -> "It was in the garden before the kitchen" names the kitchen only
   because the question did. (So a target that is itself in the question can never be
   scored correct; the bAbI generators never ask such a question.)
5. The remaining labels found must be exactly {target}: naming the target together with
   another label ("the kitchen or the garden") is wrong. A target made of several labels
   joined by commas (qa8, "apple,milk") needs exactly those labels.

Where this departs from the authors' code (both on purpose, both listed here):

- Labels are matched as whole words (not preceded or followed by a letter or digit); the
  authors test substrings. With substrings "officer" contains "office", "bedrooms" contains
  "bedroom", and worse for the later tasks, qa7's "one" is inside "none" (so the target
  "none" always finds a second label and is never correct) and qa6's "no" is inside "now"
  and "not" ("Yes, she is there now" names both "yes" and "no", and is wrong). For qa1-qa5
  the two differ only when an output carries a label inside a longer word ("bedrooms",
  "Billy"). `whole_words=False` gives the authors' substring matching, to reproduce their
  numbers exactly. Measured on the authors' published qa1-qa5 predictions (babilong_evals/
  in their repository: 99,504 outputs of two models), substring mode agrees with their code
  on every output; whole words change 14 verdicts ("Luxembourg Gardens" no longer names
  "garden", and "the office of Gardening" no longer names it as well as "office"),
  accuracy 0.5999 either way.
- A target that is not among the labels raises ValueError (their code returns False): it
  means the caller passed another task's labels, which would otherwise read as accuracy 0.
  (The parts of a comma-joined target are also stripped of spaces; the published targets
  have none.)

Their code also means to cut the output at "Question", but does so after lower-casing, so
that cut never happens; we reproduce what their code does (no cut at "question"), since it
is what the published numbers were computed with.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from data_pipeline.babilong.labels import target_labels

# Where a model stops answering and starts echoing the prompt (authors' metrics.py).
_ECHO = re.compile("<context>|<example>", re.IGNORECASE)


def first_sentence(output: str) -> str:
    """The part of `output` that is scored: up to the first ".", and before any echoed
    "<context>" / "<example>" marker (case-insensitive). Case is kept."""
    text = output.split(".", 1)[0]
    echo = _ECHO.search(text)
    return text[:echo.start()] if echo else text


def _found(labels: set[str], text: str, whole_words: bool) -> set[str]:
    """Labels (lower-case) present in `text` (lower-case)."""
    if not whole_words:
        return {label for label in labels if label in text}
    return {label for label in labels
            if re.search(rf"(?<![a-z0-9]){re.escape(label)}(?![a-z0-9])", text)}


def is_correct(output: str, target: str, question: str, labels: Sequence[str], *,
               whole_words: bool = True) -> bool:
    """BABILong's rule (module docstring): after lower-casing, the labels named in the first
    sentence of `output`, less those named in `question`, are exactly the target's.

    `labels` is the task's answer set (data_pipeline/babilong/labels.py TASK_LABELS[task]);
    `whole_words=False` matches labels as substrings, as the authors' code does."""
    label_set = {label.lower() for label in labels}
    wanted = target_labels(target, label_set)
    in_question = _found(label_set, question.lower(), whole_words)
    in_output = _found(label_set, first_sentence(output).lower(), whole_words) - in_question
    return in_output == wanted
