"""Exercises that check themselves: a cell the learner edits, a check that says pass or what is wrong,
and a solution kept in a collapsed cell that CI runs, so every exercise is proven solvable.

In a notebook:

    # your turn: edit this cell
    def bucket(n): ...                                   # YOUR CODE

    # solution (collapsed; runs only when LABKIT_SOLUTIONS=1, as in CI)
    if labkit.lessons.exercises.solutions_on():
        def bucket(n): return 8 * math.ceil(n / 8)

    labkit.lessons.exercises.check("02.bucket", lambda: nb02.check_bucket(bucket))

check() runs the notebook's checker, which raises Wrong("what is wrong") or returns a short note. A learner
sees "✓ pass" or "✗ not yet: ..." and the notebook goes on (Run all never stops at an exercise); with
LABKIT_SOLUTIONS=1 (the test suite) a wrong answer raises, so a solution that stops working fails CI.
Checkers live beside this file, one module per notebook (nb00.py, nb01.py, ...), and test the learner's
value against what it must do, never against a stored answer string.
"""

from __future__ import annotations

import os

from labkit.config import parse_bool

ENV = "LABKIT_SOLUTIONS"
results: dict[str, bool] = {}  # name -> passed, for the notebook's summary and the tests


class Wrong(AssertionError):
    """Raised by a checker: the message says what is wrong and, where it helps, a hint."""


class NotDone(Wrong):
    """The learner has not written anything yet (the cell still holds its placeholder)."""


def solutions_on() -> bool:
    """True when the hidden solution cells should run (LABKIT_SOLUTIONS=1: the test suite, an instructor)."""
    return parse_bool(os.environ.get(ENV, ""), ENV)


def check(name: str, checker) -> bool:
    """Run `checker()` (no arguments); print pass or what is wrong. Returns whether it passed.

    With solutions on, a failure raises (the test suite must see it); otherwise the notebook goes on."""
    try:
        note = checker()
    except Wrong as e:
        results[name] = False
        if solutions_on():
            raise
        print(f"✗ {name}: not yet: {e}")
        return False
    results[name] = True
    print(f"✓ {name}: pass" + (f" ({note})" if note else ""))
    return True


def require(condition: bool, message: str) -> None:
    """A checker's assert that survives `python -O`: raises Wrong(message) when condition is false."""
    if not condition:
        raise Wrong(message)


def todo(value) -> None:
    """Raise NotDone when the learner's cell still holds `...` (Ellipsis) or None."""
    if value is ... or value is None:
        raise NotDone("replace the ... in the cell above with your answer")
