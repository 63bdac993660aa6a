"""Notebook 09's checkers: the notebook's hidden solutions and a right answer pass; wrong answers, placeholders, an
answer that raises and one that calls labkit's own rule print "not yet" with a reason; and each checker's inputs tell
apart the rules a learner mixes up."""

import math
from pathlib import Path

import nbformat
import pytest

from labkit import parallel
from labkit.lessons import exercises
from labkit.lessons.exercises import NotDone, Wrong, check, nb09

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "09_past_one_device.ipynb"


def right_bytes(params, gpus, unit, gather):
    return params * 16 / gpus + unit * gather


def right_plan(params, memory, devices, hosts):
    if params * 16 <= memory / 2:
        return "replicate"
    if hosts > 1 and params * 16 / (devices // hosts) <= memory / 2:
        return "hsdp"
    return "fsdp2"


def right_accumulate(mode, params, processes, k, layers):
    shard = params * 16 // processes
    return (params * 8 + shard, 2 * layers) if mode == "gathered" else (shard, k * (2 * layers))


def boom(*args):
    raise ZeroDivisionError("the learner's bug")


CHECKERS = {
    "09.gpu_bytes": (nb09.check_gpu_bytes, right_bytes),
    "09.pick_plan": (nb09.check_pick_plan, right_plan),
    "09.accumulate": (nb09.check_accumulate, right_accumulate),
}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_right_answer_passes_and_placeholders_and_exceptions_are_not_yet(name, capsys, monkeypatch):
    checker, right = CHECKERS[name]
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert check(name, lambda: checker(right))
    for answer in (None, ..., lambda *a: None, lambda *a: ...):
        with pytest.raises(NotDone):
            checker(answer)
    assert not check(name, lambda: checker(boom))
    assert not check(name, lambda: checker(None))
    out = capsys.readouterr().out
    assert "✓ " + name in out and "your code raised ZeroDivisionError: the learner's bug" in out
    assert out.count("not yet") == 2


def test_the_notebooks_hidden_solutions_pass(monkeypatch):
    """The solution cells of notebooks/09_past_one_device.ipynb, run as CI runs them (LABKIT_SOLUTIONS=1)."""
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if "solution" in c.metadata.get("tags", [])]
    assert len(cells) == 3
    ns = {"exercises": exercises}
    for src in cells:
        exec(src, ns)  # noqa: S102 - the repository's own notebook
    assert "passed" not in ns
    nb09.check_gpu_bytes(ns["gpu_bytes"])
    nb09.check_pick_plan(ns["pick_plan"])
    nb09.check_accumulate(ns["accumulate_cost"])


def test_gpu_bytes_names_each_mistake():
    cases = {
        "split the state": lambda p, g, u, b: p * 16 + u * b,
        "forgot the gathered unit": lambda p, g, u, b: p * 16 / g,
        "12 B a weight": lambda p, g, u, b: p * 12 / g + u * b,
        "not 4": lambda p, g, u, b: p * 16 / g + u * 4,  # the first case is bf16: a unit at 4 B is wrong there
        "do not divide it": lambda p, g, u, b: p * 16 / g + u * b / g,
    }
    for hint, answer in cases.items():
        with pytest.raises(Wrong, match=hint):
            nb09.check_gpu_bytes(answer)
    with pytest.raises(Wrong, match="must be a number"):
        nb09.check_gpu_bytes(lambda *a: "14 GB")


def test_pick_plan_cases_tell_the_rules_apart():
    """Every rule a learner mixes up gives another answer on at least one case, and every plan is the answer once."""
    import random

    cases = nb09._plan_cases(random.Random(3))
    wants = [parallel.auto_plan(*c) for c in cases]
    assert set(wants) == set(nb09.PLANS)
    wrong_rules = [
        lambda p, m, d, h: "replicate" if p * 16 <= m else right_plan(p, m, d, h),  # forgot the half
        # hsdp on one host: a host's share checked without asking whether there are two hosts
        lambda p, m, d, h: (
            "hsdp" if right_plan(p, m, d, h) == "fsdp2" and p * 16 / (d // h) <= m / 2 else right_plan(p, m, d, h)
        ),
        lambda p, m, d, h: "fsdp2" if right_plan(p, m, d, h) == "hsdp" else right_plan(p, m, d, h),  # never hsdp
        lambda p, m, d, h: (
            "hsdp" if p * 16 / d <= m / 2 and right_plan(p, m, d, h) != "replicate" else right_plan(p, m, d, h)
        ),
    ]
    for rule in wrong_rules:
        assert [rule(*c) for c in cases] != wants
        with pytest.raises(Wrong, match="auto picks"):
            nb09.check_pick_plan(rule)
    with pytest.raises(Wrong, match="expected one of"):
        nb09.check_pick_plan(lambda *a: "ddp")


def test_accumulate_names_each_mistake():
    with pytest.raises(Wrong, match="gathered keeps whole weights AND whole gradients"):
        nb09.check_accumulate(
            lambda mode, p, n, k, L: (p * 16 // n, 2 * L) if mode == "gathered" else right_accumulate(mode, p, n, k, L)
        )
    with pytest.raises(Wrong, match="nothing is gathered again|k times its all-gathers"):
        nb09.check_accumulate(lambda mode, p, n, k, L: (right_accumulate(mode, p, n, k, L)[0], k * (2 * L)))
    with pytest.raises(Wrong, match="the last block stays gathered"):  # 2 L + 1: the last block gathered again
        nb09.check_accumulate(
            lambda mode, p, n, k, L: (
                right_accumulate(mode, p, n, k, L)[0],
                (2 * L + 1) * (1 if mode == "gathered" else k),
            )
        )
    with pytest.raises(Wrong, match="return a pair"):
        nb09.check_accumulate(lambda *a: 3)


def test_labkits_own_rules_are_refused(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    from labkit.parallel import accumulation_bytes as acc

    assert not check("09.pick_plan", lambda: nb09.check_pick_plan(lambda *a: parallel.auto_plan(*a)))
    assert not check(
        "09.accumulate",
        lambda: nb09.check_accumulate(lambda mode, p, n, k, L: right_accumulate(mode, p, n, k, L) and acc(p, n)),
    )
    assert not check("09.gpu_bytes", lambda: nb09.check_gpu_bytes(nb09.gpu_bytes_rule))
    assert capsys.readouterr().out.count("work it out from the inputs") == 3


def test_the_rules_are_labkits():
    """accumulate_rule's bytes are what labkit.parallel.accumulation says for fp32 fsdp2 (its message, in MB)."""
    from labkit.models.gpt import GPTConfig
    from labkit.spmd import dtensor_plans

    gathered, sharded = parallel.accumulation_bytes(10**8, 4, 4)
    cfg = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)  # the Trainer's policy: the last block kept
    per_step = dtensor_plans.predict_collectives("fsdp", cfg, 4, last_kept=True)["all-gather"]["count"]
    assert nb09.accumulate_rule("gathered", 10**8, 4, 3, 2) == (gathered, per_step) == (gathered, 4)
    assert nb09.accumulate_rule("sharded", 10**8, 4, 3, 2) == (sharded, 3 * per_step)
    assert math.isclose(nb09.gpu_bytes_rule(7 * 10**9, 8, 7 * 10**9 // 32, 2), 14e9 + 2 * (7 * 10**9 // 32))
