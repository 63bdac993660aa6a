"""Gradient accumulation in the Trainer (TrainConfig.accum_steps): the losses of the k-times larger batch, one
optimizer step per k micro-batches, an exact resume after an interrupt mid-accumulation, and no new XLA graph."""

import pytest
import torch

import labkit
from labkit import TrainConfig, Trainer
from labkit.checkpoint import CheckpointManager
from labkit.interrupts import Preempted
from tests.helpers import blobs, mlp

# float32 sums taken in another order: a gradient summed as k partial means differs from the one-batch mean by a few
# units in the last place (~1e-7 relative); over 6-8 SGD steps the losses stayed within 1.2e-7 (one float32 ulp at a
# loss near 1, measured here on CPU and XLA:CPU), so 1e-5 leaves room for other kernels and still fails on any real
# difference (a missing 1/k makes the steps 4x larger, a lost micro-batch moves the loss by percents)
TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _xla_first():
    labkit.setup("xla-cpu")  # XLA's devices start before any backward in this process (labkit.device says why)


def _trainer(rt, batch, k, *, n=256, epochs=1, cls=Trainer, momentum=0.9, **cfg):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    loader = torch.utils.data.DataLoader(blobs(n=n), batch_size=batch)  # in order: micro-batches tile big ones
    config = TrainConfig(epochs=epochs, log_every=1, eval_every=0, accum_steps=k, **cfg)
    return cls(model, opt, rt, config, loader)


def _losses(tr):
    return [h["loss"] for h in tr.history]


def test_accumulated_steps_equal_the_large_batch():
    rt = labkit.setup("cpu")
    big, acc = _trainer(rt, 32, 1), _trainer(rt, 8, 4)
    big.fit(), acc.fit()
    assert big.step == acc.step == 8
    torch.testing.assert_close(torch.tensor(_losses(acc)), torch.tensor(_losses(big)), rtol=TOL, atol=TOL)
    for (name, a), b in zip(big.module.state_dict().items(), acc.module.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL, msg=f"parameter {name}")
    assert [h["examples"] for h in acc.history] == [32] * 8  # a record counts the step's samples, not a micro-batch's
    assert acc.global_batch() == 32
    # the loss is what was divided by k: without it the step is k times larger and the weights differ
    plain = _trainer(rt, 8, 4)
    plain.backward = lambda loss: plain.precision.backward(loss)  # the undivided loss
    plain.fit()
    assert abs(_losses(plain)[-1] - _losses(big)[-1]) > 100 * TOL


def test_one_optimizer_step_per_k_micro_batches():
    rt = labkit.setup("cpu")
    calls = {"train_step": 0, "opt": 0}

    class Counting(Trainer):
        def train_step(self, batch):
            calls["train_step"] += 1
            return super().train_step(batch)

    tr = _trainer(rt, 8, 3, n=80, epochs=2, cls=Counting)  # 10 micro-batches an epoch: 3 steps, 1 left over
    tr.optimizer.register_step_post_hook(lambda *a: calls.__setitem__("opt", calls["opt"] + 1))
    sched = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
    tr.scheduler = sched
    tr.fit()
    assert tr.steps_per_epoch() == 3 and tr.step == 6
    assert calls == {"train_step": 18, "opt": 6}  # the leftover micro-batch of each epoch is neither run nor stepped
    assert sched.last_epoch == 6  # the scheduler counts optimizer steps
    assert [h["step"] for h in tr.history] == [1, 2, 3, 4, 5, 6]
    assert all(p.grad is None for p in tr.module.parameters())  # nothing half-accumulated is left behind


def test_resume_after_an_interrupt_mid_accumulation(tmp_path):
    """Checkpoints are taken only between optimizer steps: a run stopped in the middle of an accumulation resumes
    from the last step and trains the whole accumulation again, giving the uninterrupted run's losses."""
    rt = labkit.setup("cpu")
    ref = _trainer(rt, 8, 3, n=96, epochs=2)  # 12 micro-batches an epoch: 4 steps
    ref.fit()

    class PreemptedAt(Trainer):
        calls = 0

        def train_step(self, batch):
            PreemptedAt.calls += 1
            if PreemptedAt.calls == 8:  # the 2nd micro-batch of step 3: one micro-batch's gradient in .grad
                raise Preempted("SIGTERM (simulated) mid-accumulation")
            return super().train_step(batch)

    ck = CheckpointManager(str(tmp_path), keep=2, rt=rt)
    first = _trainer(rt, 8, 3, n=96, epochs=2, cls=PreemptedAt, checkpoint_every=1)
    first.checkpoint = ck
    with pytest.raises(Preempted):
        first.fit()
    assert ck.latest()["step"] == 2 and first.step == 2
    torch.manual_seed(123)  # another initial model: only the checkpoint can give the reference's losses
    second = _trainer(rt, 8, 3, n=96, epochs=2, checkpoint_every=1, resume=True)
    second.module.load_state_dict(mlp(seed=5).state_dict())
    second.checkpoint = CheckpointManager(str(tmp_path), keep=2, rt=rt)
    second.fit()
    assert second.step == ref.step == 8
    assert _losses(first) + _losses(second) == _losses(ref)  # the same arithmetic in the same order: bit for bit


def test_accumulation_compiles_no_new_graph_on_xla():
    """On XLA:CPU the micro-step is one graph, the same every time; the last micro-batch with the optimizer step is
    another: after the first two optimizer steps (momentum appears at the second) nothing new is compiled."""
    import torch_xla.debug.metrics as met

    rt = labkit.setup("xla-cpu")
    tr = _trainer(rt, 8, 3, n=144, max_steps=2)  # 18 micro-batches: 6 steps

    def uncached():
        # graphs new to the process: compiled now, or read from a persistent cache (labkit.compile_cache)
        return (met.counter_value("UncachedCompile") or 0) + (met.counter_value("PersistentCacheHit") or 0)

    c0 = uncached()
    tr.fit()
    warm = uncached() - c0
    tr.cfg.max_steps = 6
    c1 = uncached()
    tr.fit()  # continues at step 2, batch 2 of the epoch
    assert tr.step == 6
    assert uncached() - c1 == 0, "a new graph after warm-up"
    # first micro-step (no .grad yet), middle micro-step (.grad +=), last micro + optimizer at step 1 and at step 2
    assert warm == 4, warm
    cpu = _trainer(labkit.setup("cpu"), 24, 1, n=144)
    cpu.fit()
    torch.testing.assert_close(torch.tensor(_losses(tr)), torch.tensor(_losses(cpu)), rtol=TOL, atol=TOL)


def test_accum_steps_is_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(accum_steps=0)
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(accum_steps=True)
    monkeypatch.setenv("LABKIT_ACCUM_STEPS", "4")
    assert TrainConfig.from_env().accum_steps == 4


def test_scaled_lr_rules():
    from labkit.optim import scaled_lr

    assert scaled_lr(0.1, 384, 384 * 8) == pytest.approx(0.8)  # 8 chips: the linear rule
    assert scaled_lr(1e-3, 32, 32 * 4, "sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(0.1, 32, 64, "cubic")


class _Batched(torch.utils.data.IterableDataset):
    """A dataset that batches itself (as a shard stream does): its DataLoader's batch_size is None."""

    batch_size = 4

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def test_a_last_partial_accumulation_is_said_once_with_the_samples_it_costs(capsys):
    """7 batches of 4 at k = 3: 2 optimizer steps an epoch, the 7th batch never trained. Whether the loader says its
    batch size (a DataLoader), its dataset does (batch_size=None, a stream that batches itself) or nothing does (a
    list of batches: the first batch is counted), one line says the 4 samples each epoch leaves out."""
    from labkit.loader import DeviceLoader, epoch_leftovers

    rt = labkit.setup("cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(7)]
    plain = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.cat, zip(*batches))), batch_size=4)
    for loader in (plain, torch.utils.data.DataLoader(_Batched(batches), batch_size=None), batches):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tr = Trainer(model, opt, rt, TrainConfig(epochs=2, log_every=1, eval_every=0, accum_steps=3), loader)
        tr.fit()
        assert tr.step == 4  # 2 an epoch
        said = [ln for ln in capsys.readouterr().out.splitlines() if "each epoch leaves out" in ln]
        assert len(said) == 1, (type(loader).__name__, said)  # two epochs, one fit(): once
        assert "4 in the last 1 batch(es), fewer than accum_steps=3" in said[0], said
    # under torchrun: each process's samples, and all of them
    line = epoch_leftovers(DeviceLoader(plain, rt), 3, world_size=2)
    assert "on each of the 2 processes (8 in all)" in line, line
