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


@pytest.mark.timing
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


def test_exit_and_any_base_exception_in_the_learners_code_is_not_yet(learner, capsys):
    import sys

    assert ex.check("t.exit", lambda: _check_double(lambda x: sys.exit(3))) is False
    assert "your code called exit() (SystemExit: 3)" in _said(capsys, "t.exit")
    assert ex.check("t.exit2", lambda: exit()) is False  # raised by the notebook's check line itself
    assert "SystemExit" in _said(capsys, "t.exit2")

    def gen_exit(x):
        raise GeneratorExit("closed")

    assert ex.check("t.gen", lambda: _check_double(gen_exit)) is False
    assert "your code raised GeneratorExit: closed" in _said(capsys, "t.gen")
    with pytest.raises(KeyboardInterrupt):  # the learner's own stop still stops
        ex.check("t.kbd", lambda: _check_double(lambda x: (_ for _ in ()).throw(KeyboardInterrupt)))


class _Lib:
    def __init__(self, n):
        self.n = n

    def count(self):
        return 2 * self.n

    @property
    def size(self):
        return 3 * self.n


def _lib_answer(n):
    return 2 * n


def _wrapper(n):
    return _lib_answer(n)


_wrapper.__wrapped__ = _lib_answer


class _Sub(_Lib):
    def __init__(self, n):
        super().__init__(n)  # a closure over __class__: the refused code must match it


def test_a_refusal_closes_every_path_to_the_function_object(learner):
    import types

    saved = _lib_answer  # a reference saved before the refusal, as `from x import f` makes
    bound = _Lib(4).count
    code_copy = types.FunctionType(_lib_answer.__code__, globals())
    paths = [
        lambda: saved(1),
        lambda: _wrapper.__wrapped__(1),
        lambda: bound(),
        lambda: _Lib(1),
        lambda: _Sub(2),  # a subclass's constructor reaches the refused one through super()
        lambda: _Lib.__new__(_Lib).size,
        lambda: code_copy(1),  # a function rebuilt from the code object: caught when the block ends
    ]
    for path in paths:
        with pytest.raises(Wrong, match="count it yourself"):
            with ex.refusing([_lib_answer, _Lib, _Lib.count, _Lib.size, _Sub], "count it yourself"):
                path()
    # everything is back afterwards
    assert saved(2) == 4 and bound() == 8 and _Sub(2).size == 6 and code_copy(3) == 6
    with ex.refusing([_lib_answer], "no"):
        assert 2 * 5 == 10  # the learner's own arithmetic runs


def test_a_hint_names_a_mistake_only_when_no_other_gives_that_answer():
    wrong = {"forgot the values": 50, "forgot the batch": 50, "counted heads twice": 400}
    assert ex.mistake(50, 100, wrong) == ""  # two mistakes give 50: naming one would mislead
    assert ex.mistake(400, 100, wrong) == "counted heads twice"
    assert ex.mistake(100, 100, wrong) == "" and ex.mistake(7, 100, wrong) == ""
