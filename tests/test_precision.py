"""labkit.precision: the dtype per chip (CUDA capability faked on this CPU machine), the GradScaler in the
Trainer, and MFU against the peak of the dtype actually run."""

import pytest
import torch

import labkit
from labkit.dashboard import flops
from labkit.precision import Precision, choose


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA GPU with the given name and capability is attached (queries only; nothing runs on it)."""

    def install(name, cap):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        return labkit.Runtime("cuda", torch.device("cuda", 0))

    return install


@pytest.mark.parametrize(
    "name,cap,want,scaler",
    [
        ("Tesla T4", (7, 5), "fp16", True),
        ("Tesla V100-SXM2-16GB", (7, 0), "fp16", True),
        ("NVIDIA L4", (8, 9), "bf16", False),
        ("NVIDIA A100-SXM4-40GB", (8, 0), "bf16", False),
        ("NVIDIA H100 80GB HBM3", (9, 0), "bf16", False),
    ],
)
def test_auto_on_gpus(fake_gpu, name, cap, want, scaler):
    p = choose(fake_gpu(name, cap), "auto")
    assert p.name == want and p.device_type == "cuda" and p.needs_scaler == scaler
    assert f"compute capability {cap[0]}.{cap[1]}" in p.reason
    assert choose(fake_gpu(name, cap), "true").name == want  # the notebooks' bf16=true: the 16-bit type that fits
    assert choose(fake_gpu(name, cap), False).name == "fp32"


def test_bf16_on_a_t4_is_refused_with_the_fix(fake_gpu):
    with pytest.raises(ValueError, match=r"bf16 on Tesla T4, compute capability 7\.5.*'fp16'"):
        choose(fake_gpu("Tesla T4", (7, 5)), "bf16")


def test_tpu_xla_cpu_and_cpu():
    assert choose(labkit.Runtime("tpu", torch.device("cpu")), "auto").name == "bf16"
    with pytest.raises(ValueError, match="fp16 on a TPU"):
        choose(labkit.Runtime("tpu", torch.device("cpu")), "fp16")
    xla = labkit.setup("xla-cpu")
    assert choose(xla, "auto").name == "fp32" and choose(xla, "true").name == "bf16"
    cpu = labkit.Runtime("cpu", torch.device("cpu"))
    assert choose(cpu, "auto").name == "fp32" and choose(cpu, "true").name == "fp32"
    with pytest.raises(ValueError, match="'maybe'"):
        choose(cpu, "maybe")


def test_xla_cpu_bf16_autocast_really_casts():
    rt = labkit.setup("xla-cpu")
    lin = torch.nn.Linear(4, 2).to(rt.device)
    with choose(rt, "bf16").autocast():
        assert lin(torch.ones(1, 4, device=rt.device)).dtype == torch.bfloat16


def test_fp16_with_grad_scaler_in_the_trainer():
    """The fp16 path (T4/V100) end to end on the CPU: autocast fp16, scaled backward, unscale + step."""
    torch.manual_seed(0)
    rt = labkit.setup("cpu")
    prec = Precision("fp16", "cpu", "test")
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long()
    loader = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    cfg = labkit.TrainConfig(epochs=6, log_every=4, clip_norm=1.0)
    tr = labkit.Trainer(model, opt, rt, cfg, loader, precision=prec)
    assert tr.precision.scaler is not None and tr.precision.scale() == 65536.0
    assert tr.precision.scaler is not prec.scaler  # each Trainer its own loss scale
    hist = tr.fit()
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.1, [h["loss"] for h in hist]
    assert "scaler" in tr.state_dict()  # the loss scale survives a checkpoint
    again = labkit.Trainer(model, opt, rt, cfg, loader, precision=prec)
    again.load_state_dict(tr.state_dict())
    assert again.precision.state_dict() == tr.precision.state_dict()
    assert choose(rt, "auto").grad_scaler() is None  # fp32 needs none


class InfGrads(labkit.Trainer):
    """A finite loss whose gradients overflow: what fp16 does when the loss scale is too high for them."""

    def train_step(self, batch):
        loss = super().train_step(batch)
        next(self.model.parameters()).grad.fill_(float("inf"))
        return loss


def _fp16_trainer(cls, **cfg):
    labkit.setup("xla-cpu")  # before any backward: autograd sizes its per-device queues at its first one
    torch.manual_seed(0)
    rt = labkit.setup("cpu")
    x = torch.randn(256, 8)
    loader = [(x[i : i + 16], (x[i : i + 16, 0] > 0).long()) for i in range(0, 256, 16)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    return cls(
        model, opt, rt, labkit.TrainConfig(log_every=4, **cfg), loader, precision=Precision("fp16", "cpu", "test")
    )


def test_fp16_steps_the_grad_scaler_skips_are_counted_and_stop_the_run():
    """Before: with inf gradients under a finite loss the GradScaler skipped every step, the weights never
    changed, and fit() ended as if it had trained. Now each record counts skipped_steps (read from the
    per-step loss scale in the log closure: no host sync per step) and 10 in a row stop the run."""
    tr = _fp16_trainer(InfGrads, epochs=1)
    before = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(FloatingPointError, match=r"skipped 10 steps in a row up to step 10 .*log of step 12"):
        tr.fit()  # seen where the scales are read anyway: at the log of step 12
    assert [h["skipped_steps"] for h in tr.history] == [4, 4, 4] and tr.step == 12
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, tr.model.parameters()))  # truly never stepped
    on = _fp16_trainer(InfGrads, epochs=1, continue_on_nonfinite=True)
    with pytest.warns(RuntimeWarning, match="skipped 10 steps in a row"):
        on.fit()
    assert on.step == 16 and sum(h["skipped_steps"] for h in on.history) == 16
    healthy = _fp16_trainer(labkit.Trainer, epochs=2)
    healthy.fit()
    assert sum(h["skipped_steps"] for h in healthy.history) < 3  # at most the first scale's back-off


def test_peaks_per_dtype_and_mfu(fake_gpu):
    t4 = fake_gpu("Tesla T4", (7, 5))
    assert flops.peak_flops(t4, "fp32")[0] == 8.1e12
    assert flops.peak_flops(t4, "fp16")[0] == 65e12
    peak, source = flops.peak_flops(t4, "bf16")
    assert peak is None and "no bf16" in source
    assert flops.peak_flops(t4)[0] == 65e12  # no dtype: what auto runs there (fp16)
    # the T4 bug this fixes: an fp32 run measured against the fp16 peak read 8x too low
    step_flops, step_s = 4e12, 1.0
    assert flops.mfu(step_flops, step_s, flops.peak_flops(t4, "fp32")[0]) == pytest.approx(4 / 8.1)
    assert flops.peak_flops(fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0)))[0] == 312e12
    assert flops.peak_flops(fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0)), "fp32")[0] == 19.5e12
    assert flops.peak_flops(fake_gpu("Tesla V100-SXM2-16GB", (7, 0)), "fp16")[0] == 125e12
    assert flops.lookup("TPU v5 lite", "fp32") == ("TPU v5e", 197e12)  # XLA's default matmul precision: 1 bf16 pass
    assert flops.lookup("NVIDIA L4", "fp32") == ("L4", 30.3e12)
    for key, per in flops.PEAKS.items():  # every chip has a 16-bit and an fp32 figure, fp32 never above 16-bit
        assert per["fp32"] <= flops.PEAK_FLOPS[key], key
