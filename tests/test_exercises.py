"""The one place every exercise check goes through (labkit.lessons.exercises.check): whatever the learner's code
does, a learner sees "✗ name: not yet: why" and the notebook goes on; with solutions on, it raises."""

import time

import numpy as np
import pytest

from labkit.lessons import exercises as ex
from labkit.lessons.exercises import NotDone, Wrong


@pytest.fixture
def learner(monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")


def _check_double(fn):
    for x in (3, 7.5, -2):
        got = ex.number(ex.call(fn, x), f"double({x})")
        ex.require(got == 2 * x, f"double({x}) = {got}, want {2 * x}")
    return "three inputs"


def _said(capsys, name):
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if f" {name}:" in ln]
    return line


def test_a_right_answer_passes(learner, capsys):
    assert ex.check("t.ok", lambda: _check_double(lambda x: 2 * x)) is True
    assert _said(capsys, "t.ok") == "✓ t.ok: pass (three inputs)" and ex.results["t.ok"] is True


@pytest.mark.parametrize(
    "answer, why",
    [
        (..., "replace the ... in the cell above"),  # the cell as the notebook ships it
        (None, "replace the ... in the cell above"),
        (lambda x: ..., "your function returns nothing yet"),  # def f(x): ... (the body left as it was)
        (lambda x: None, "your function returns nothing yet"),
        (42, "expected a function, got int"),
        (lambda x: 1 / 0, r"your code raised ZeroDivisionError: division by zero \(at test_exercises.py:\d+\)"),
        (lambda x: [2 * x], "must be a number .* got list"),
        (lambda x: str(2 * x), "must be a number .* got str"),
        (lambda x: True, "is a bool"),
        (lambda x: float("nan"), "give a finite number"),
        (lambda x: 2 * x + 1, r"double\(3\) = 7.0, want 6"),
    ],
)
def test_whatever_the_learner_writes_is_not_yet_and_never_a_crash(learner, capsys, answer, why):
    import re

    assert ex.check("t.x", lambda: _check_double(answer)) is False
    line = _said(capsys, "t.x")
    assert line.startswith("✗ t.x: not yet: ") and re.search(why, line), line
    assert ex.results["t.x"] is False


class LiesAboutEverything:
    def __eq__(self, other):
        return True

    def __bool__(self):
        return True

    def __float__(self):
        return 6.0

    __hash__ = object.__hash__


class LyingFloat(float):
    def __eq__(self, other):
        return True

    def __float__(self):
        return 6.0

    __hash__ = float.__hash__


def test_an_object_whose_eq_lies_never_reaches_a_comparison(learner, capsys):
    assert ex.check("t.lie", lambda: _check_double(lambda x: LiesAboutEverything())) is False
    assert "must be a number" in _said(capsys, "t.lie")
    # a float subclass is read as the float it is, not as what its __eq__ / __float__ say
    assert ex.number(LyingFloat(1.5)) == 1.5 and type(ex.number(LyingFloat(1.5))) is float
    assert ex.check("t.lie2", lambda: _check_double(lambda x: LyingFloat(0.0))) is False
    assert "want 6" in _said(capsys, "t.lie2")
    with pytest.raises(Wrong):
        ex.require(LiesAboutEverything(), "a truthy object is not a bool")
    ex.require(np.bool_(True), "numpy's bool is a bool")
    assert ex.number(np.float32(2.5)) == 2.5 and ex.integer(np.int64(7)) == 7
    with pytest.raises(Wrong, match="whole number"):
        ex.integer(2.5)


def test_a_loop_that_never_ends_hits_the_time_limit(learner, capsys):
    def forever(x):
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # a learner's blanket except does not swallow the time limit
                pass

    t0 = time.perf_counter()
    assert ex.check("t.slow", lambda: _check_double(forever), time_limit=0.5) is False
    assert time.perf_counter() - t0 < 5
    assert "the check ran past 0.5 s: does your code loop forever" in _said(capsys, "t.slow")
    # the alarm is off again: a later slow call is not interrupted
    time.sleep(0.7)


def test_an_exception_in_the_checker_line_itself_is_not_yet(learner, capsys):
    # the notebook's check lambda can use the learner's value directly (e.g. unpack it): still "not yet"
    def unpacks():
        epoch, idx = None  # what `epoch, idx = resume_position(...)` did with a placeholder
        return "never"

    assert ex.check("t.unpack", unpacks) is False
    assert "your code raised TypeError: cannot unpack non-iterable NoneType" in _said(capsys, "t.unpack")


def test_with_solutions_on_a_failure_raises(monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    with pytest.raises(NotDone):
        ex.check("t.on", lambda: _check_double(...))
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        ex.check("t.on", lambda: _check_double(lambda x: 1 / 0))
    with pytest.raises(ex.TooSlow):
        ex.check("t.on", lambda: time.sleep(5), time_limit=0.2)


def test_close_says_how_far_off(learner):
    assert ex.close(101.0, 100.0, 0.05, "bytes") == pytest.approx(0.01)
    with pytest.raises(Wrong, match=r"bytes: you say 150, it is 100 \(50% off, within 5% passes\); count the bias"):
        ex.close(150.0, 100.0, 0.05, "bytes", hint="count the bias")
