"""Notebook 04's checkers measure what XLA did: graphs compiled, device->host transfers, where the result lives. Each
accepts a right answer and turns away wrong and faked ones (a hard-coded count, a formula that confuses two
quantities, a lying __eq__, work on the host, an exception in the learner's code) with a message saying why."""

import math

import pytest
import torch

import labkit
from labkit.lessons.exercises import NotDone, Wrong, nb04


@pytest.fixture(scope="module")
def rt():
    return labkit.setup("xla-cpu")


class Liar(int):
    """An int whose comparisons always say yes."""

    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def test_predict_graphs(rt):
    def right(lengths, m):
        return len({m * math.ceil(n / m) for n in lengths})

    assert "for" in nb04.check_predict_graphs(right, rt)
    assert "for" in nb04.check_predict_graphs(right, rt)  # again: new lengths, new widths, still measured right
    with pytest.raises(Wrong, match="reuse its graph"):
        nb04.check_predict_graphs(lambda lengths, m: len(lengths), rt)
    with pytest.raises(Wrong, match="several lengths share one padded shape"):
        nb04.check_predict_graphs(lambda lengths, m: len(set(lengths)), rt)
    with pytest.raises(Wrong, match="you say 3|reuse its graph|share one padded shape"):
        nb04.check_predict_graphs(lambda lengths, m: 3, rt)
    for _ in range(3):  # the floor or the nearest multiple instead of the ceiling: wrong on every call
        with pytest.raises(Wrong, match="you say"):
            nb04.check_predict_graphs(lambda lengths, m: len({m * (n // m) for n in lengths}), rt)
        with pytest.raises(Wrong, match="you say"):
            nb04.check_predict_graphs(lambda lengths, m: len({m * round(n / m) for n in lengths}), rt)


def test_predictions_that_measure_are_refused(rt):
    def measured_graphs(lengths, m):  # run the padded batches and count, as the check does
        c0 = nb04.compiles()
        w = torch.randn(7, 3, device=rt.device)
        for n in lengths:
            (torch.ones(m * math.ceil(n / m), 7, device=rt.device) @ w).sum().item()
        return nb04.compiles() - c0

    with pytest.raises(Wrong, match="runs nothing on the device"):
        nb04.check_predict_graphs(measured_graphs, rt)
    from labkit.lessons.exercises.nb04 import guarded_loop  # saved by name before the check

    def ran_the_loop(steps, log_every):
        t0 = nb04.transfers()
        guarded_loop(torch.eye(4, device=rt.device), steps, log_every, rt.sync)
        return nb04.transfers() - t0

    with pytest.raises(Wrong, match="running it and counting is the check's part"):
        nb04.check_predict_reads(ran_the_loop, rt)

    def copied_loop(steps, log_every):  # the loop's code copied into the answer, run and counted
        t0, w = nb04.transfers(), torch.eye(4, device=rt.device)
        for step in range(steps):
            loss = (w @ w).tanh().mean()
            rt.sync()
            bool(loss.isnan())
            if step % log_every == 0:
                loss.item()
        loss.item()
        return nb04.transfers() - t0

    with pytest.raises(Wrong, match="runs nothing on the device.*device->host copies"):
        nb04.check_predict_reads(copied_loop, rt)
    with pytest.raises(Wrong, match="must be a number"):
        nb04.check_predict_graphs(lambda lengths, m: object(), rt)
    with pytest.raises(NotDone):
        nb04.check_predict_graphs(lambda lengths, m: None, rt)


def test_predict_reads(rt, capsys):
    def right(steps, log_every):
        return steps + math.ceil(steps / log_every) + 1  # the guard, the logs (from step 0), the final read

    note = nb04.check_predict_reads(right, rt)
    assert note.count(" for (") == 3 and "not measured" not in note
    assert "step 0" not in capsys.readouterr().out  # the loop's own log lines stay inside the check
    # the logs counted without step 0, or the final read forgotten: the same number whenever steps is no multiple of
    # log_every, so the check names neither (a hint would name the wrong one half the time)
    for wrong in (lambda s, k: s + s // k + 1, lambda s, k: s + math.ceil(s / k)):
        with pytest.raises(Wrong, match=r"you say \d+, torch_xla counted \d+ transfers$"):
            nb04.check_predict_reads(wrong, rt)
    with pytest.raises(Wrong, match="an `if` on a device tensor is a read too"):
        nb04.check_predict_reads(lambda s, k: math.ceil(s / k) + 1, rt)
    with pytest.raises(Wrong, match="torch_xla counted"):
        nb04.check_predict_reads(lambda s, k: 14, rt)  # hard-coded
    with pytest.raises(Wrong, match="must be a number"):
        nb04.check_predict_reads(lambda s, k: str(right(s, k)), rt)
    with pytest.raises(Wrong, match=r"your code raised ZeroDivisionError"):
        nb04.check_predict_reads(lambda s, k: s // 0, rt)


def test_liar_is_not_a_number(rt):
    """An int subclass whose __eq__ lies is read as the plain int it holds: the lie never reaches a comparison."""
    with pytest.raises(Wrong, match="you say 0"):
        nb04.check_predict_reads(lambda s, k: Liar(0), rt)
    with pytest.raises(Wrong, match="you say 0"):
        nb04.check_predict_graphs(lambda lengths, m: Liar(0), rt)


def test_branch_free(rt):
    assert "one graph, no read" in nb04.check_branch_free(lambda h: torch.where(h.sum() > 0, h * 2, h - 1), rt)
    with pytest.raises(Wrong, match=r"device->host reads in 6 calls .*the branch still reads the device"):
        nb04.check_branch_free(nb04.reference_branchy, rt)
    with pytest.raises(Wrong, match="the result is on cpu"):
        nb04.check_branch_free(lambda h: nb04.reference_branchy(h.cpu()), rt)
    with pytest.raises(Wrong, match="reads in 6 calls"):  # on the host and back: torch_xla counts the copies
        nb04.check_branch_free(lambda h: nb04.reference_branchy(h.to("cpu")).to(h.device), rt)
    with pytest.raises(Wrong, match="values differ"):
        nb04.check_branch_free(lambda h: h * 2, rt)
    with pytest.raises(Wrong, match="your code raised AttributeError"):
        nb04.check_branch_free(lambda h: h.no_such_method(), rt)


def _slowest(events):
    total = {}
    for e in events:  # fusion.3 and fusion.7 are two instructions: each name summed apart
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur_us"]
    return max(total, key=total.get)


@pytest.mark.parametrize("backend", ["xla-cpu", "cpu"])
def test_slowest_op(backend):
    rt = labkit.setup(backend)
    assert "in a fresh capture" in nb04.check_slowest_op(_slowest, rt)
    with pytest.raises(Wrong, match="the instruction run most often"):
        nb04.check_slowest_op(lambda ev: max({e["name"] for e in ev}, key=[e["name"] for e in ev].count), rt)
    with pytest.raises(Wrong, match="not its longest single run"):
        nb04.check_slowest_op(lambda ev: max(ev, key=lambda e: e["dur_us"])["name"], rt)

    def by_base_name(ev):  # fusion.3 + fusion.7 summed as "fusion": two instructions merged
        import re

        total = {}
        for e in ev:
            name = re.sub(r"\.\d+$", "", e["name"])
            total[name] = total.get(name, 0.0) + e["dur_us"]
        return max(total, key=total.get)

    with pytest.raises(Wrong, match="do not merge them by base name"):
        nb04.check_slowest_op(by_base_name, rt)

    def by_base_then_instance(ev):  # the right base name, then its first instance: still merged
        base = by_base_name(ev)
        return next(e["name"] for e in ev if e["name"].startswith(base + "."))

    with pytest.raises(Wrong, match="you say"):
        nb04.check_slowest_op(by_base_then_instance, rt)
    from labkit.profiling.analysis import rank_ops  # saved by name before the check

    with pytest.raises(Wrong, match="labkit's own ranking"):
        nb04.check_slowest_op(lambda ev: rank_ops(ev)[0][0], rt)
    with pytest.raises(Wrong, match="a str"):
        nb04.check_slowest_op(lambda ev: 3, rt)
    with pytest.raises(NotDone):
        nb04.check_slowest_op(lambda ev: None, rt)
