"""labkit.optim.warmup_cosine: the schedule the notebooks use."""

import math

import pytest
import torch

from labkit.optim import WarmupCosine, warmup_cosine


def _lrs(warmup, total, floor, steps):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    sched = warmup_cosine(opt, warmup, total, floor)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, sched


def test_warmup_then_cosine_to_floor_then_flat():
    lrs, _ = _lrs(4, 20, 0.1, 30)
    assert lrs[:4] == pytest.approx([0.5 * k / 4 for k in (1, 2, 3, 4)])  # linear warm-up
    assert lrs[4] == pytest.approx(0.5)  # the peak right after it
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert lrs[12] == pytest.approx(0.5 * mid)  # half way through the decay
    assert all(a >= b for a, b in zip(lrs[4:21], lrs[5:21]))  # monotone down
    assert lrs[20:] == pytest.approx([0.05] * 10)  # floor, flat after `total`


def test_matches_the_formula_the_notebooks_used():
    total, warm = 88, 8
    f = WarmupCosine(warm, total, 0.02)
    old = lambda s: (
        (s + 1) / warm
        if s < warm
        else 0.02
        + 0.98
        * 0.5
        * (  # noqa: E731
            1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm)))
        )
    )
    assert [f(s) for s in range(120)] == pytest.approx([old(s) for s in range(120)], rel=1e-12)


def test_state_dict_is_weights_only_safe(tmp_path):
    _, sched = _lrs(2, 10, 0.0, 5)
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back["lr_lambdas"][0] == {"warmup": 2, "total": 10, "floor": 0.0} and back["last_epoch"] == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="floor"):
        WarmupCosine(1, 10, 1.5)
