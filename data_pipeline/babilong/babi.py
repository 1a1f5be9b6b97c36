"""bAbI stories for BABILong's qa1-qa5, generated offline and seeded.

The tasks are Weston et al. 2015 §3 tasks 1-5, as BABILong uses them (Kuratov et al. 2024):
a story is a list of fact sentences and one question whose answer is one word, a label of
labels.TASK_LABELS[task] (what BABILong's scoring looks for). The world the facts come from
is data_pipeline/babilong/world.py; this module decides what is asked and which facts the
answer rests on (`Story.supporting`, indices into `facts`, as bAbI's files list them):

- qa1 single supporting fact: people move. "Where is Mary?" -> her last move's room.
- qa2 two supporting facts: people also get and drop objects. "Where is the football?" ->
  the room of its holder (the get and the holder's last move) or where it was dropped (the
  drop and the dropper's last move before it).
- qa3 three supporting facts: "Where was the football before the kitchen?" -> the room the
  football was carried from into the kitchen (the get, the carrier's move to that room, and
  the move into the kitchen).
- qa4 two-argument relations: rooms' compass relations. "What is north of the bedroom?" /
  "What is the bedroom north of?", asked in either direction of the fact that answers it.
- qa5 three-argument relations: people also give objects to each other. "Who gave the
  football to Jeff?", "What did Fred give to Jeff?", "Who did Fred give the football to?",
  "Who received the football?", "Who gave the football?" -> one give fact.

Every story has exactly one correct label, whatever reading of the question one takes: the
room asked about in qa3 is one the object entered once; in qa5 the question's named
arguments match exactly one give in the story; in qa4 each pair of rooms is related once on
a grid. A story is drawn by simulating the world and then choosing among the questions that
qualify; a story that offers none is drawn again from the same generator (so the result is
still a function of the generator's state).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .world import (
    GIVERS,
    MAX_RELATIONS,
    MOVERS,
    OBJECTS,
    OPPOSITE,
    Event,
    World,
    grid_relations,
    simulate,
)

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")

# Facts per story when n_facts is None: uniform over the range the original stories have,
# as BABILong counts them (the "facts per task" table of Kuratov et al. 2024 and of the
# authors' repository README: each question keeps every fact told before it, so a story's
# length is the number of sentences up to its question): qa1 2-10, qa2 2-68, qa3 4-32,
# qa4 always 2, qa5 2-126.
FACT_RANGES = {"qa1": (2, 10), "qa2": (2, 68), "qa3": (4, 32), "qa4": (2, 2), "qa5": (2, 126)}
# The fewest facts a story can have: its supporting facts (qa1 1, qa2 2, qa3 3, qa4 1), and
# for qa5 one more, since a give needs the giver to have got the object first. qa4 has at
# most MAX_RELATIONS facts (world.grid_relations).
MIN_FACTS = {"qa1": 1, "qa2": 2, "qa3": 3, "qa4": 1, "qa5": 2}
SUPPORTING_FACTS = {"qa1": 1, "qa2": 2, "qa3": 3, "qa4": 1, "qa5": 1}

# How often each kind of action is drawn while it is possible (world.simulate). Moves
# dominate, as in the original stories; qa5 gives often enough that short stories have
# one, and long ones still leave question patterns that match a single give.
_WEIGHTS = {
    "qa1": {"move": 1.0},
    "qa2": {"move": 0.55, "get": 0.25, "drop": 0.2},
    "qa3": {"move": 0.55, "get": 0.25, "drop": 0.2},
    "qa5": {"move": 0.4, "get": 0.2, "drop": 0.1, "give": 0.3},
}
_MAX_DRAWS = 100_000   # never reached in practice (tests measure the draws needed)


@dataclass(frozen=True)
class Story:
    task: str
    facts: tuple[str, ...]        # sentences ending with "."
    question: str                 # ends with "?"
    answer: str                   # one label of labels.TASK_LABELS[task]
    supporting: tuple[int, ...]   # indices into facts, ascending


def generate_story(task: str, rng: np.random.Generator, n_facts: int | None = None) -> Story:
    """One story of `task` with n_facts facts (None: drawn from FACT_RANGES[task]).
    Deterministic in the state of `rng`."""
    if task not in TASKS:
        raise ValueError(f"unknown bAbI task {task!r}; expected one of {', '.join(TASKS)}")
    if n_facts is None:
        lo, hi = FACT_RANGES[task]
        n_facts = int(rng.integers(lo, hi + 1))
    elif isinstance(n_facts, bool) or not isinstance(n_facts, (int, np.integer)):
        raise ValueError(f"n_facts={n_facts!r} must be an integer")
    elif n_facts < MIN_FACTS[task]:
        raise ValueError(f"n_facts={n_facts} is too small for {task}: it needs at least "
                         f"{MIN_FACTS[task]} facts")
    elif task == "qa4" and n_facts > MAX_RELATIONS:
        raise ValueError(f"n_facts={n_facts} is too large for qa4: six rooms on a grid have "
                         f"at most {MAX_RELATIONS} neighbour relations")
    n_facts = int(n_facts)
    if task == "qa4":
        return _qa4(rng, n_facts)
    actors = GIVERS if task == "qa5" else MOVERS
    ask = {"qa1": _ask_qa1, "qa2": _ask_qa2, "qa3": _ask_qa3, "qa5": _ask_qa5}[task]
    for _ in range(_MAX_DRAWS):
        events, sentences = simulate(rng, actors, n_facts, _WEIGHTS[task])
        asked = ask(events, rng)
        if asked is not None:
            question, answer, supporting = asked
            return Story(task, tuple(sentences), question, answer, tuple(sorted(supporting)))
    raise RuntimeError(f"no {task} story with {n_facts} facts in {_MAX_DRAWS} draws")


def generate_stories(task: str, n: int, seed: int) -> list[Story]:
    """n stories of `task` from numpy's default generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    return [generate_story(task, rng) for _ in range(n)]


def _choose(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))] if items else None


def _ask_qa1(events: list[Event], rng: np.random.Generator):
    last_move = {ev.actor: i for i, ev in enumerate(events)}
    person = _choose(rng, sorted(last_move, key=last_move.get))
    if person is None:
        return None
    i = last_move[person]
    return f"Where is {person}?", events[i].thing, (i,)


def _ask_qa2(events: list[Event], rng: np.random.Generator):
    world = World(MOVERS)
    last_move: dict[str, int] = {}
    last_touch: dict[str, tuple[int, int | None]] = {}  # object -> (get/drop, mover's move)
    for i, ev in enumerate(events):
        world.apply(ev)
        if ev.kind == "move":
            last_move[ev.actor] = i
        elif ev.kind == "drop":
            last_touch[ev.thing] = (i, last_move.get(ev.actor))
        else:
            last_touch[ev.thing] = (i, None)
    asked = []
    for obj in OBJECTS:
        if obj not in last_touch:
            continue
        touch, move = last_touch[obj]
        if events[touch].kind == "get":   # still held: the holder's last move says where
            move = last_move.get(events[touch].actor)
        if move is not None:
            asked.append((f"Where is the {obj}?", world.where(obj), (touch, move)))
    return _choose(rng, asked)


def _ask_qa3(events: list[Event], rng: np.random.Generator):
    """The object's last change of room, when its carrier walked it there from a stated room
    (the move before the carrier's last). Only a room the object entered once is asked
    about. After that move the object must stay where it is even for a reader who skips any
    fact the answer does not rest on: nobody picks it up again, and if the carrier puts it
    down, the carrier never walks back into that room (otherwise, skipping the drop would
    carry the object out and back in)."""
    world = World(MOVERS)
    rooms: dict[str, list[tuple[str, int]]] = {o: [] for o in OBJECTS}  # (room, event)
    # (move, object carried) -> (the carrier's get of it, the carrier's move before)
    chain: dict[tuple[int, str], tuple[int, int | None]] = {}
    last_move: dict[str, int] = {}
    last_get: dict[str, int] = {}
    for i, ev in enumerate(events):
        before = {o: world.where(o) for o in OBJECTS}
        world.apply(ev)
        for obj in OBJECTS:
            now = world.where(obj)
            if now is not None and now != before[obj]:
                rooms[obj].append((now, i))
                if ev.kind == "move":
                    chain[i, obj] = (last_get[obj], last_move.get(ev.actor))
        if ev.kind == "move":
            last_move[ev.actor] = i
        elif ev.kind == "get":
            last_get[ev.thing] = i
    asked = []
    for obj in OBJECTS:
        if len(rooms[obj]) < 2:
            continue
        (before_room, _), (room, i) = rooms[obj][-2:]
        if events[i].kind != "move" or chain[i, obj][1] is None:
            continue
        if sum(r == room for r, _ in rooms[obj]) != 1 or not _stays(events, i, obj, room):
            continue
        asked.append((f"Where was the {obj} before the {room}?", before_room,
                      (*chain[i, obj], i)))
    return _choose(rng, asked)


def _stays(events: list[Event], i: int, obj: str, room: str) -> bool:
    carrier = events[i].actor
    dropped = False
    for ev in events[i + 1:]:
        if ev.thing == obj and ev.kind in ("get", "give"):
            return False
        dropped |= ev.kind == "drop" and ev.thing == obj
        if dropped and ev.kind == "move" and ev.actor == carrier and ev.thing == room:
            return False
    return True


# qa5's question forms: (template, the give's arguments the question names, its answer).
_QA5_FORMS = (
    ("Who gave the {thing} to {to}?", ("thing", "to"), "actor"),
    ("What did {actor} give to {to}?", ("actor", "to"), "thing"),
    ("Who did {actor} give the {thing} to?", ("actor", "thing"), "to"),
    ("Who received the {thing}?", ("thing",), "to"),
    ("Who gave the {thing}?", ("thing",), "actor"),
)


def _ask_qa5(events: list[Event], rng: np.random.Generator):
    """A question form first (uniformly among those some give answers alone), then one of
    the gives that are the only match of that form's named arguments."""
    gives = [(i, ev) for i, ev in enumerate(events) if ev.kind == "give"]
    by_form = []
    for template, named, answer in _QA5_FORMS:
        keys = Counter(tuple(getattr(ev, f) for f in named) for _, ev in gives)
        only = [(i, ev) for i, ev in gives if keys[tuple(getattr(ev, f) for f in named)] == 1]
        if only:
            by_form.append((template, answer, only))
    form = _choose(rng, by_form)
    if form is None:
        return None
    template, answer, only = form
    i, ev = _choose(rng, only)
    question = template.format(actor=ev.actor, thing=ev.thing, to=ev.to)
    return question, getattr(ev, answer), (i,)


# qa4's questions about a fact (a, direction, b), "The a is direction of the b.": the two
# ways to ask for either room, in the fact's direction and in the opposite one.
def _qa4(rng: np.random.Generator, n_facts: int) -> Story:
    relations = grid_relations(rng, n_facts)
    facts = tuple(f"The {a} is {d} of the {b}." for a, d, b in relations)
    k = int(rng.integers(len(relations)))
    a, d, b = relations[k]
    forms = [(f"What is {d} of the {b}?", a), (f"What is the {a} {d} of?", b),
             (f"What is {OPPOSITE[d]} of the {a}?", b), (f"What is the {b} {OPPOSITE[d]} of?", a)]
    question, answer = forms[int(rng.integers(len(forms)))]
    return Story("qa4", facts, question, answer, (k,))
