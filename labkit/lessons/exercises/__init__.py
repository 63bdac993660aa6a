"""Exercises that check themselves: a cell the learner edits, a check that says pass or what is wrong,
and a solution kept in a collapsed cell that CI runs, so every exercise is proven solvable.

In a notebook:

    # your turn: edit this cell
    def bucket(n): ...                                   # YOUR CODE

    # solution (collapsed; runs only when LABKIT_SOLUTIONS=1)
    if labkit.lessons.exercises.solutions_on():
        def bucket(n): return 8 * math.ceil(n / 8)

    labkit.lessons.exercises.check("02.bucket", lambda: nb02.check_bucket(bucket))

check() is the one place that turns whatever the learner's code does into "✓ pass" or "✗ not yet: why": a
placeholder (`...`, None), a wrong type or shape, an exception inside the learner's code ("your code raised
X: ..."), an object whose `__eq__` lies, a loop that never ends (a time limit). Run all never stops at an
exercise. With LABKIT_SOLUTIONS=1 (an instructor, the solutions-on test runs) a failure raises instead, so a
solution that stops working fails CI.

Checkers live beside this file, one module per notebook (nb00.py, nb01.py, ...). They call the learner's code
through call(), read numbers through number() / integer() (plain Python values: a lying `__eq__` never reaches
a comparison), vary their inputs on every call, and judge what the code does (the values it returns, where its
tensors live, what torch_xla's counters say), never the text of the answer.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import signal
import threading
import time
import traceback

from labkit.codepaths import is_labkit_file
from labkit.config import parse_bool

ENV = "LABKIT_SOLUTIONS"
TIME_LIMIT_S = 120.0  # a check that runs longer than this is a learner's loop that never ends (checks take < 30 s)
results: dict[str, bool] = {}  # name -> passed, for the notebook's summary and the tests


class Wrong(AssertionError):
    """Raised by a checker: the message says what is wrong and, where it helps, a hint."""


class NotDone(Wrong):
    """The learner has not written anything yet (the cell still holds its placeholder)."""


class TooSlow(BaseException):
    """The check ran past its time limit. A BaseException, so a learner's `except Exception:` cannot swallow it."""


def solutions_on() -> bool:
    """True when the hidden solution cells should run (LABKIT_SOLUTIONS=1: the test suite, an instructor)."""
    return parse_bool(os.environ.get(ENV, ""), ENV)


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise TooSlow in the main thread after `seconds` (SIGALRM; a notebook cell runs in the main thread).
    Elsewhere (a worker thread, Windows) there is no limit. Re-armed every second after the first alarm, in case
    the learner's code catches BaseException too. An alarm already set (pytest-timeout's hang guard) is kept:
    if it comes first, its own handler runs, and it is re-armed with what is left of it afterwards."""
    if not (seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()):
        yield
        return
    start = time.monotonic()
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)

    def _alarm(signum, frame):
        if outer_left and time.monotonic() - start >= outer_left and callable(old):
            old(signum, frame)  # the outer alarm's time has come: its handler decides
        raise TooSlow(seconds)

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_left or seconds), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 0.01))


def _where(e: BaseException) -> str:
    """'(file:line)' of the innermost frame outside labkit: where in the learner's code it went wrong."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not is_labkit_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    name = os.path.basename(f.filename)
    in_a_cell = name.startswith("<ipython") or "ipykernel_" in f.filename  # a notebook cell's code
    return f" (line {f.lineno} of its cell)" if in_a_cell else f" (at {name}:{f.lineno})"


def _raised(e: BaseException) -> str:
    """'your code raised X: first line (where)', for any exception the learner's code raised."""
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, SystemExit):
        return f"your code called exit() (SystemExit: {e.code}){_where(e)}: a check goes on, return a value instead"
    return f"your code raised {type(e).__name__}: {first}{_where(e)}"


def check(name: str, checker, time_limit: float = TIME_LIMIT_S) -> bool:
    """Run `checker()` (no arguments); print pass or what is wrong. Returns whether it passed.

    Whatever happens inside (Wrong, NotDone, an exception from the learner's code, a time-out) becomes
    "✗ name: not yet: why". With solutions on, a failure raises (the test suite must see it)."""
    try:
        with _deadline(time_limit):
            note = checker()
    except KeyboardInterrupt:  # the learner stopped the cell: Run all stops, as it should
        raise
    except BaseException as e:  # SystemExit (exit()), GeneratorExit, TooSlow, any Exception: "not yet"
        results[name] = False
        if solutions_on():
            raise
        if isinstance(e, Wrong):
            why = str(e)
        elif isinstance(e, TooSlow):
            why = f"the check ran past {time_limit:g} s: does your code loop forever, or wait on something?"
        else:
            why = _raised(e)
        print(f"✗ {name}: not yet: {why}")
        return False
    results[name] = True
    print(f"✓ {name}: pass" + (f" ({note})" if note else ""))
    return True


def require(condition, message: str) -> None:
    """A checker's assert that survives `python -O`: raises Wrong(message) when condition is false.
    `condition` must be a real bool (or numpy bool): an object with a lying `__bool__` is not accepted."""
    if type(condition).__name__ not in ("bool", "bool_") or not condition:
        raise Wrong(message)


def todo(value) -> None:
    """Raise NotDone when the learner's cell still holds `...` (Ellipsis) or None."""
    if value is ... or value is None:
        raise NotDone("replace the ... in the cell above with your answer")


def call(fn, *args, **kwargs):
    """Call the learner's function `fn`. A placeholder (`...`, None, not callable) or a function that returns
    `...`/None is NotDone; an exception inside it becomes Wrong("your code raised X: ..."), naming the line."""
    todo(fn)
    if not callable(fn):
        raise Wrong(f"expected a function, got {type(fn).__name__}")
    try:
        out = fn(*args, **kwargs)
    except (Wrong, TooSlow, KeyboardInterrupt):
        raise
    except BaseException as e:  # SystemExit from exit() too: Run all goes on
        raise Wrong(_raised(e)) from None
    if out is ... or out is None:
        raise NotDone("your function returns nothing yet: replace the ... in its body")
    return out


def number(value, what: str = "your answer") -> float:
    """`value` as a plain, finite Python float. Accepts int/float (numpy scalars too); refuses placeholders,
    bools, strings, tensors, NaN and any other object (whose `__eq__` or `__float__` could say anything)."""
    todo(value)
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise Wrong(f"{what} is a bool ({value}); give a number")
    if isinstance(value, float):
        out = float.__float__(value)  # the float itself, not a subclass's __float__
    elif isinstance(value, int):
        out = float(int.__index__(value))
    elif isinstance(value, numbers.Real) and type(value).__module__ == "numpy":
        out = float(value)
    else:
        raise Wrong(f"{what} must be a number (int or float), got {type(value).__name__}")
    if not math.isfinite(out):
        raise Wrong(f"{what} is {out}: give a finite number")
    return out


def integer(value, what: str = "your answer") -> int:
    """`value` as a plain Python int; a float is accepted only when it is a whole number."""
    x = number(value, what)
    if x != int(x):
        raise Wrong(f"{what} is {x}: a count is a whole number")
    return int(x)


def close(got: float, want: float, rel: float, what: str, hint: str = "") -> float:
    """Require |got - want| <= rel * |want| (plain floats); return the relative error."""
    err = abs(got - want) / max(abs(want), 1e-300)
    require(
        err <= rel,
        f"{what}: you say {got:,.4g}, it is {want:,.4g} ({err:.0%} off, within {rel:.0%} passes)"
        + (f"; {hint}" if hint else ""),
    )
    return err


def mistake(got, want, wrong: dict[str, object]) -> str:
    """The one mistake that explains `got`: `wrong` maps a hint to the answer that mistake gives. A hint is named only
    when `got` is not the right answer and exactly one mistake gives it (two mistakes with the same answer leave the
    learner a question, not a false lead); otherwise ''."""
    if got == want:
        return ""
    hits = [hint for hint, value in wrong.items() if value == got and value != want]
    return hits[0] if len(hits) == 1 else ""


_reasons: list[str] = []  # why each refusal in force refuses, innermost last


def _refuse():
    """What a refused function runs instead of its body (see refusing)."""
    raise Wrong(_reasons[-1] if _reasons else "the library's own answer is refused here")


def _refusing_code(free: int):
    """A code object that calls _refuse(), with `free` free variables (a function's __code__ can only be swapped
    for one with as many as its closure has: a method that calls super() has one, `__class__`). It names no global:
    it runs with the refused function's globals, so it reaches _refuse through the builtin __import__."""
    names = [f"_v{i}" for i in range(free)]
    src = "def outer():\n" + "".join(f"    {n} = None\n" for n in names)
    src += "    def refused(*args, **kwargs):\n"
    src += f"        {', '.join(names)}\n" if names else ""
    src += "        __import__('labkit.lessons.exercises', fromlist=['_refuse'])._refuse()\n"
    src += "    return refused\n"
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - fixed text built above, no input in it
    return ns["outer"]().__code__


def _functions(target) -> list:
    """The plain Python functions behind `target`: a function and every function its __wrapped__ chain reaches,
    a bound method's, a property's getter, a staticmethod's or classmethod's, a class's own __init__."""
    import types

    if isinstance(target, type):
        target = target.__dict__.get("__init__")
    if isinstance(target, property):
        target = target.fget
    out, seen = [], set()
    while target is not None and id(target) not in seen:
        seen.add(id(target))
        if isinstance(target, (types.MethodType, staticmethod, classmethod)):
            target = target.__func__
            continue
        if isinstance(target, types.FunctionType):
            out.append(target)
        target = getattr(target, "__wrapped__", None)
    return out


@contextlib.contextmanager
def refusing(targets, why: str, builtins=()):
    """While the learner's code runs, the library functions in `targets` (functions, methods, properties, classes:
    their __init__) refuse: they raise Wrong(why). What is refused is the function object itself (its code is
    swapped), so every path to it is closed: the attribute, a reference saved earlier, `from x import f`, a bound
    method, a subclass or a submodule that calls it. A function rebuilt from a saved copy of its code object is
    caught too: the calls of every refused code object are watched (sys.setprofile) and any call is Wrong(why)
    when the block ends. Used where the library computes the very answer (the measurement, or what the exercise
    rebuilds). `builtins`: functions written in C (torch_xla._XLAC's), whose code cannot be swapped: a call of
    one is seen by the same watch (a 'c_call' event) and is Wrong(why) when the block ends."""
    import sys

    funcs = list({id(f): f for t in targets for f in _functions(t)}.values())  # once each: restored to its own code
    saved = [(f, f.__code__) for f in funcs]
    codes = {id(code) for _, code in saved}
    reached = []

    c_funcs = list(builtins)

    def watch(frame, event, arg):
        if event == "call" and id(frame.f_code) in codes:
            reached.append(frame.f_code.co_name)
        elif event == "c_call" and any(arg is f for f in c_funcs):
            reached.append(getattr(arg, "__name__", "a builtin"))

    old_profile = sys.getprofile()
    _reasons.append(why)
    for f, code in saved:
        f.__code__ = _refusing_code(len(code.co_freevars))
    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(old_profile)
        for f, code in saved:
            f.__code__ = code
        _reasons.pop()
    if reached:
        raise Wrong(why)


_DEVICE_WORK = {
    "CompileTime": "graph(s) compiled",
    "ExecuteTime": "graph(s) run",
    "TransferToDeviceTime": "host->device copies",
    "TransferFromDeviceTime": "device->host copies",
}


@contextlib.contextmanager
def predicting(rt, what: str = "a prediction"):
    """Around a learner's prediction: it must make the device do nothing (torch_xla's counts of graphs compiled and
    run and of copies either way do not move), so running the thing and counting, by whatever path, is Wrong. On a
    runtime without torch_xla's counters (`rt.reads_metrics` false, or rt None) nothing is watched: the checker's
    note says so."""
    if rt is None or not getattr(rt, "reads_metrics", False):
        yield
        return
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # work queued before the answer runs finishes first: it is not the answer's
    before = {n: xla_metric(n)[0] for n in _DEVICE_WORK}
    yield
    moved = {n: xla_metric(n)[0] - v for n, v in before.items() if xla_metric(n)[0] != v}
    if moved:
        said = ", ".join(f"{k} {_DEVICE_WORK[n]}" for n, k in moved.items())
        raise Wrong(
            f"{what} runs nothing on the device, the check measures after your answer; while your code ran torch_xla "
            f"counted {said}: work it out from the inputs"
        )


def xla_metric(name: str) -> tuple[int, float]:
    """(samples, summed value) of one torch_xla metric in this process (CompileTime, TransferFromDeviceTime,
    OutboundData, ...): what the checkers count. (0, 0.0) before the metric's first sample."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)
