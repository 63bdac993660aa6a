"""Notebook 04's checkers measure what XLA did: graphs compiled, recompiles after warm-up, reads of the device."""

import math

import pytest
import torch

import labkit
from labkit.lessons.exercises import NotDone, Wrong, nb04


@pytest.fixture(scope="module")
def rt():
    return labkit.setup("xla-cpu")


def test_predict_graphs(rt):
    assert "for" in nb04.check_predict_graphs(lambda lengths, m: len({m * math.ceil(n / m) for n in lengths}), rt)
    with pytest.raises(Wrong, match="reuse its graph"):
        nb04.check_predict_graphs(lambda lengths, m: len(lengths), rt)
    with pytest.raises(Wrong, match="several lengths share one padded shape"):
        nb04.check_predict_graphs(lambda lengths, m: len(set(lengths)), rt)
    with pytest.raises(Wrong, match="you say 3"):
        nb04.check_predict_graphs(lambda lengths, m: 3, rt)
    with pytest.raises(NotDone):
        nb04.check_predict_graphs(lambda lengths, m: None, rt)


def test_choose_pad(rt):
    from labkit.dashboard import HealthMonitor

    emb = torch.nn.Linear(8, 8).to(rt.device)

    def run(batches, pad_to=None):  # notebook 04's section 3, in small
        mon = HealthMonitor(rt, warmup_steps=2)
        for step, n in enumerate(batches):
            ids = torch.randn(4, n, 8)
            if pad_to:
                ids = torch.nn.functional.pad(ids, (0, 0, 0, pad_to - n))
            ids = ids.to(rt.device)
            emb(ids).pow(2).mean()
            rt.sync()
            mon.on_step(step, {"ids": ids})
        return mon

    assert "0 recompiles" in nb04.check_choose_pad(max, run)
    with pytest.raises(Wrong, match="shorter than the longest batch"):
        nb04.check_choose_pad(min, run)
    with pytest.raises(Wrong, match="columns of padding more than needed"):
        nb04.check_choose_pad(lambda lengths: 32, run)


def test_branch_free(rt):
    assert "one graph, no read" in nb04.check_branch_free(lambda h: torch.where(h.sum() > 0, h * 2, h - 1), rt)
    with pytest.raises(Wrong, match=r"device->host reads in 6 calls .*the branch still reads the device"):
        nb04.check_branch_free(nb04.reference_branchy, rt)
    with pytest.raises(Wrong, match="the result is on cpu"):
        nb04.check_branch_free(lambda h: nb04.reference_branchy(h.cpu()), rt)
    with pytest.raises(Wrong, match="values differ"):
        nb04.check_branch_free(lambda h: h * 2, rt)
