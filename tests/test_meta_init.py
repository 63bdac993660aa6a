"""labkit.meta_init: a meta-device build gives every tensor the values of a CPU build of the same seed (bit for bit),
leaves the CPU generator where that build leaves it, or refuses by name. One process, plus one child process for
the shards (a fake process group of 3 ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from labkit import meta_init
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parent.parent


def _same_as_cpu(make, after=None):
    """(CPU build's state, meta build's state after materialize, both generators' next draws)."""
    torch.manual_seed(0)
    ref = make()
    if after is not None:
        with torch.no_grad():
            after(ref)
    ref_next = torch.rand(4)
    model = meta_init.build(make, seed=0)
    if after is not None:
        meta_init.record(model, after)
    meta_next = torch.rand(4)
    meta_init.materialize(model, "cpu")
    return ref.state_dict(), model.state_dict(), ref_next, meta_next


def _assert_same(make, after=None):
    ref, got, ref_next, meta_next = _same_as_cpu(make, after)
    assert list(ref) == list(got)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert torch.equal(ref_next, meta_next), "the CPU generator is not where a CPU build leaves it"


class _Eye(nn.Module):  # nn.init.eye_ is torch.eye(..., out=w): an out= write, after the constructor's kaiming init
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        nn.init.eye_(self.lin.weight)
        self.register_buffer("steps", torch.empty(3, dtype=torch.long))
        torch.arange(3, out=self.steps)


def test_out_writes_are_recorded():
    _assert_same(_Eye)


class _TwoOuts(nn.Module):  # torch.max(..., out=(values, indices)) writes two meta tensors in one op
    def __init__(self):
        super().__init__()
        src = torch.randn(4, 3)
        self.register_buffer("best", torch.empty(3))
        self.register_buffer("where", torch.empty(3, dtype=torch.long))
        torch.max(src, 0, out=(self.best, self.where))


def test_an_op_writing_several_tensors_is_refused_naming_op_and_tensor():
    model = meta_init.build(_TwoOuts, seed=0)
    with pytest.raises(ValueError, match=r"best .*max"):
        meta_init.materialize(model, "cpu")


class _Random(nn.Module):
    """Random factories as parameters, and random tensors used only to build others or thrown away."""

    def __init__(self):
        super().__init__()
        self.r = nn.Parameter(torch.randn(3, 5))
        self.register_buffer("perm", torch.randperm(6))
        self.register_buffer("ints", torch.randint(0, 9, (4,)))
        self.scaled = nn.Parameter(torch.rand(2, 3) * 0.5 + torch.normal(torch.zeros(2, 3), torch.ones(2, 3)))
        torch.randn(7)  # thrown away: the generator still moves
        self.lin = nn.Linear(4, 4)  # drawn after all of them
        self.q = nn.Parameter(torch.empty(4, 6))
        nn.init.orthogonal_(self.q)  # a QR of a random draw, copied into a view of q


def test_random_factories_advance_the_generator_as_a_cpu_build():
    _assert_same(_Random)


class _RandomFromUnseen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.bernoulli(torch.tensor([0.5, 0.5]))  # a literal: its values never pass the recorder
        self.lin = nn.Linear(2, 2)


def test_a_random_op_on_values_never_seen_is_refused_at_build():
    with pytest.raises(ValueError, match="bernoulli"):
        meta_init.build(_RandomFromUnseen, seed=0)


class _Reused(nn.Module):  # freed storages whose addresses a later tensor may receive
    def __init__(self):
        super().__init__()
        for _ in range(4):
            tmp = torch.empty(4, 4)
            tmp.fill_(7.0)
            del tmp
        self.register_buffer("zeros", torch.zeros(4, 4))


def test_a_freed_storage_hands_no_ops_to_a_later_tensor():
    _assert_same(_Reused)


def _zero_weight(m):
    nn.init.zeros_(m.lin.weight)


def test_an_init_after_build_is_recorded_or_refused():
    _assert_same(_Eye, after=_zero_weight)  # meta_init.record: the values of the CPU build followed by it
    model = meta_init.build(_Eye, seed=0)
    _zero_weight(model)  # no recorder saw it
    with pytest.raises(ValueError, match=r"lin\.weight was written in place after build"):
        meta_init.materialize(model, "cpu")


class _Blank(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.w = nn.Parameter(torch.empty(2, 2))  # nothing initialises it: init_fn's to fill


def test_init_fn_runs_on_the_materialized_tensors_and_must_fill_what_nothing_initialised():
    with pytest.raises(ValueError, match=r"\bw was made by an empty constructor"):
        meta_init.materialize(meta_init.build(_Blank, seed=0), "cpu")
    model = meta_init.build(_Blank, seed=0, init_fn=lambda m: m.lin.bias.fill_(3.0))
    with pytest.raises(ValueError, match=r"\bw was made by an empty constructor.*init_fn did not write it"):
        meta_init.materialize(model, "cpu")

    def fill(m):
        m.w.fill_(2.0)
        m.lin.bias.fill_(3.0)

    model = meta_init.build(_Blank, seed=0, init_fn=fill)
    meta_init.materialize(model, "cpu")
    torch.manual_seed(0)
    ref = _Blank()
    assert torch.equal(model.lin.weight, ref.lin.weight)  # replayed first, then init_fn
    assert (model.w == 2.0).all() and (model.lin.bias == 3.0).all()


def test_shards_are_cut_on_the_cpu_and_init_fn_has_no_one_process_parity():
    """fully_shard over a fake process group of 3 (the last rank: uneven shares). Each shard equals the CPU build's
    part; no whole tensor is moved to the device; init_fn's random draw on the shards differs from a CPU build
    followed by init_fn (its constant does not)."""
    p = subprocess.run(
        [sys.executable, "tests/children/meta_shards.py"],
        cwd=ROOT,
        env=child_env(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and len(lines) == 2, p.stdout + p.stderr[-3000:]
    shards, after = lines
    assert all(shards["equal"].values()), shards
    assert shards["moved"] == [], shards  # only Tensor.to of a whole tensor would show here
    assert after["init_fn"] == {"lin.weight": False, "lin.bias": True} and after["bias_3"], after


class _Norms(nn.Module):  # BatchNorm's num_batches_tracked: torch.tensor(0) (never seen by the recorder), then zero_()
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("seen", torch.tensor([1.0, 2.0]))
        self.seen.mul_(2.0)  # reads values the recorder never saw: refused, not replayed on garbage


def test_values_never_seen_are_usable_once_overwritten_and_refused_when_read():
    model = meta_init.build(_Norms, seed=0)
    with pytest.raises(ValueError, match=r"\bseen was made where labkit.meta_init could not see it"):
        meta_init.materialize(model, "cpu")
    _assert_same(lambda: nn.BatchNorm1d(3))


class _Tied(nn.Module):  # nanoGPT's and Hugging Face's tying: one matrix, two names
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def _one_step(model, opt):
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    opt.step()
    return loss.item()


def test_a_tied_weight_stays_one_tensor_and_steps_as_the_cpu_build():
    import labkit

    labkit.setup("xla-cpu")  # XLA's devices start before this backward (labkit.device says why)
    from types import SimpleNamespace

    from labkit.parallel.plans import Single

    torch.manual_seed(0)
    ref = _Tied()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = meta_init.build(_Tied, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # built on the meta model, as a Trainer's user does
    model = Single(SimpleNamespace(device=torch.device("cpu"))).wrap(model, opt)
    assert model.head.weight is model.emb.weight
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert _one_step(ref, ref_opt) == _one_step(model, opt)
    for name, t in ref.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name


def test_a_replaced_parameter_or_storage_is_refused_and_a_tie_after_build_is_kept():
    model = meta_init.build(_Eye, seed=0)
    model.lin.weight = nn.Parameter(torch.empty(5, 5, device="meta"))
    with pytest.raises(ValueError, match=r"lin\.weight was replaced after build"):
        meta_init.materialize(model, "cpu")
    model = meta_init.build(_Eye, seed=0)
    model.lin.bias.data = torch.empty(5, device="meta")  # the same Parameter, a storage no recorder saw
    with pytest.raises(ValueError, match=r"lin\.bias's storage was replaced after build"):
        meta_init.materialize(model, "cpu")

    def tie_after(m):
        m.head.weight = m.emb.weight

    class _Untied(_Tied):
        def __init__(self):
            super().__init__()
            self.head.weight = nn.Parameter(torch.randn(7, 4))

    torch.manual_seed(0)
    ref = _Untied()
    tie_after(ref)
    model = meta_init.build(_Untied, seed=0)
    tie_after(model)
    meta_init.materialize(model, "cpu")
    assert model.head.weight is model.emb.weight and torch.equal(model.emb.weight, ref.emb.weight)
