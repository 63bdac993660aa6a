"""The memory format as the runtime's decision (labkit.runtime.layout): what each backend chooses and says, the
loader's batches, losses against NCHW, checkpoints free of layout, and the CUDA defaults (fused AdamW, cuDNN's
autotuner) decided without a GPU. The probe's verdict is tested on injected measurements, never on a timing.
Under DDP and FSDP2: tests/test_fsdp_resnet.py (torchrun)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torchvision.models.resnet import BasicBlock, ResNet

import labkit
from labkit.precision import Precision
from labkit.runtime import CudaRuntime, Runtime, XlaRuntime
from labkit.runtime.cuda import cudnn_benchmark
from labkit.runtime.layout import CONTIGUOUS, Layout, decide, decide_from_probe, has_conv2d, match_state

CL = torch.channels_last


def _mlp():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))


def _resnet():
    """A small ResNet (torchvision's, one BasicBlock per stage): BatchNorm, strided and 1x1 convolutions."""
    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _runtimes():
    """A runtime object of each family; their layout methods are pure (no device is touched)."""
    return {
        "cpu": Runtime("cpu", torch.device("cpu")),
        "cuda": Runtime("cuda", torch.device("cuda", 0)),
        "xla": Runtime("xla-cpu", torch.device("cpu")),
    }


def test_each_backend_decides_and_says_why_once(capsys):
    rts = _runtimes()
    assert isinstance(rts["cuda"], CudaRuntime) and isinstance(rts["xla"], XlaRuntime)
    got = {k: rt.choose_layout(_resnet()) for k, rt in rts.items()}
    assert got["cuda"].channels_last and not got["cpu"].channels_last and not got["xla"].channels_last
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all(line.startswith("[labkit] memory format: ") for line in out), out
    assert "channels_last: CUDA: tensor cores read NHWC" in out[1] and "29.5 ms in channels_last" in out[1]
    assert "contiguous (NCHW): XLA chooses its own layouts" in out[2]
    assert "contiguous (NCHW): the plain CPU" in out[0] and "memory_format='probe'" in out[0]
    for rt in rts.values():  # the same decision again: not said again
        rt.choose_layout(_resnet())
    assert capsys.readouterr().out == ""
    for rt in rts.values():  # no 2-D convolution: contiguous everywhere, with that reason
        assert rt.choose_layout(_mlp()) == Layout(False, "the model has no 2-D convolution")
    # XLA keeps contiguous even when asked, and says it ignored the setting
    assert "memory_format='channels_last' ignored" in rts["xla"].choose_layout(_resnet(), "channels_last").why


def test_settings_probe_verdict_and_a_bad_setting():
    model, default = _resnet(), Layout(False, "default")
    assert decide(model, "auto", default) is default
    assert decide(model, "channels_last", default).channels_last
    assert not decide(model, "contiguous", Layout(True, "d")).channels_last
    fast, slow, even = (lambda: (0.3, 0.1)), (lambda: (0.1, 0.3)), (lambda: (0.105, 0.1))
    assert decide(model, "probe", default, probe=fast).channels_last
    assert not decide(model, "probe", default, probe=slow).channels_last
    assert not decide(model, "probe", default, probe=even).channels_last  # 1.05x: under the margin
    assert "300.0 ms in NCHW, 100.0 ms in channels_last (3.00x" in decide_from_probe(0.3, 0.1).why
    assert not decide(_mlp(), "probe", default, probe=fast).channels_last  # no probe for a model without convs
    for rt in _runtimes().values():
        with pytest.raises(ValueError, match="memory_format='nhwc'"):
            rt.choose_layout(model, "nhwc")
    with pytest.raises(ValueError, match="TrainConfig.memory_format='nhwc'"):
        labkit.TrainConfig(memory_format="nhwc")
    assert has_conv2d(model) and not has_conv2d(_mlp())


class _Seen(labkit.Trainer):
    """Notes each batch's format and, beside each step's loss, the loss of an NCHW copy of the same weights."""

    def train_step(self, batch):
        self.formats = getattr(self, "formats", []) + [batch[0].is_contiguous(memory_format=CL)]
        nchw = copy.deepcopy(self.module).to(memory_format=torch.contiguous_format)
        with torch.no_grad(), self.autocast():
            twin = self.loss_fn(nchw(batch[0].contiguous()), batch[1])
        loss = super().train_step(batch)
        self.pairs = getattr(self, "pairs", []) + [(float(loss), float(twin))]
        return loss


def _data(n=3, bs=16, side=32):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(
        torch.randn(n * bs, 3, side, side, generator=g), torch.randint(0, 10, (n * bs,))
    )
    return torch.utils.data.DataLoader(ds, batch_size=bs)


def _trainer(fmt, precision="fp32", steps=3):
    rt = labkit.setup("cpu")
    model = _resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cfg = labkit.TrainConfig(max_steps=steps, log_every=1, eval_every=0, memory_format=fmt, compile="off")
    return _Seen(model, opt, rt, cfg, _data(steps), precision=Precision(precision, "cpu", "test"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_channels_last_trains_with_the_losses_of_nchw(precision):
    """A small ResNet on the CPU, channels_last against NCHW: the loader hands the images over in the run's format and
    the weights follow it. Each step's loss equals an NCHW copy's on the same weights within bf16 rounding (2^-8
    relative, two roundings) under bf16 autocast, within float32 rounding in fp32; in fp32 the two runs' 3-step
    trajectories agree too, within 1e-3 (under bf16 BatchNorm's cancellations amplify a rounding within a step or two, so the
    trajectories are compared in fp32 only)."""
    runs = {}
    for fmt in ("channels_last", "contiguous"):
        t = _trainer(fmt, precision)
        t.fit()
        runs[fmt] = t
    cl, nchw = runs["channels_last"], runs["contiguous"]
    assert cl.layout.channels_last and cl.formats == [True] * 3 and nchw.formats == [False] * 3
    assert cl.module.conv1.weight.is_contiguous(memory_format=CL)
    assert not nchw.module.conv1.weight.is_contiguous(memory_format=CL)
    tol = 2 * 2**-8 if precision == "bf16" else 1e-5
    assert len(cl.pairs) == 3 and all(abs(a - b) <= tol * abs(b) for a, b in cl.pairs), cl.pairs
    if precision == "fp32":
        # Two trajectories drift apart by float32 rounding that BatchNorm amplifies step by step: the losses agreed to
        # 1e-7 on one x86 CPU and differed by 6.6e-5 relative at step 3 on an AMD EPYC (oneDNN sums an NHWC convolution
        # in another order there). A layout bug (weights and images in different formats) is off by tenths.
        a, b = [r["loss"] for r in cl.history], [r["loss"] for r in nchw.history]
        assert len(a) == 3 and all(abs(x - y) <= 1e-3 * abs(y) for x, y in zip(a, b)), (a, b)


def test_checkpoints_are_free_of_layout():
    """A channels_last run's checkpoint loads into an NCHW Trainer and back with equal state dicts; each model keeps
    its own format, and the optimizer's momenta follow their weights (match_state)."""
    cl = _trainer("channels_last", steps=1)
    cl.fit()
    buf = io.BytesIO()
    torch.save(cl.state_dict(), buf)
    nchw = _trainer("contiguous", steps=1)
    buf.seek(0)
    nchw.load_state_dict(torch.load(buf, weights_only=True))
    a, b = cl.module.state_dict(), nchw.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not nchw.module.conv1.weight.is_contiguous(memory_format=CL)
    back = _trainer("channels_last", steps=1)
    buf = io.BytesIO()
    torch.save(nchw.state_dict(), buf)
    buf.seek(0)
    back.load_state_dict(torch.load(buf, weights_only=True))
    c = back.module.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert back.module.conv1.weight.is_contiguous(memory_format=CL)
    w = back.module.conv1.weight
    assert back.optimizer.state[w]["momentum_buffer"].stride() == w.stride()
    assert torch.equal(
        back.optimizer.state[w]["momentum_buffer"], cl.optimizer.state[cl.module.conv1.weight]["momentum_buffer"]
    )


def test_match_state_and_batches():
    p = torch.nn.Parameter(torch.randn(4, 3, 2, 2).contiguous(memory_format=CL))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    v = torch.randn(4, 3, 2, 2)
    opt.state[p]["momentum_buffer"] = v
    match_state(opt)
    assert opt.state[p]["momentum_buffer"].stride() == p.stride() and torch.equal(opt.state[p]["momentum_buffer"], v)
    x, y = torch.randn(2, 3, 4, 4), torch.arange(2)
    bx, by = Layout(True, "t").batch((x, y))
    assert bx.is_contiguous(memory_format=CL) and torch.equal(bx, x) and by is y
    assert CONTIGUOUS.batch((x, y))[0] is x
    assert Layout(True, "t").batch({"m": torch.randn(2, 3, 4)})["m"].is_contiguous()  # 3-D: as it is


def test_cuda_defaults_are_chosen_for_cuda_only():
    rts = _runtimes()
    assert rts["cuda"].adamw_options() == {"capturable": False, "fused": True}
    assert rts["cpu"].adamw_options() == {"capturable": False}
    assert rts["xla"].adamw_options() == {"capturable": True}
    assert cudnn_benchmark(True)[0] and not cudnn_benchmark(False)[0]
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        rts["cpu"].autotune(True)
        rts["xla"].autotune(True)
        assert torch.backends.cudnn.benchmark is False  # the CPU and XLA paths leave it alone
        rts["cuda"].autotune(True)
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
    # the models' own optimizers on the CPU are what they were: no fused= passed
    from labkit.models import gpt, image_optimizer

    rt = rts["cpu"]
    opt = image_optimizer(_resnet(), "adamw", 1e-3, xla=rt.capturable_optimizers, fused=rt.fused_optimizers)
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["capturable"] is False
    opt = gpt.adamw(_mlp(), 1e-3, rt=rt)
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["capturable"] is False
