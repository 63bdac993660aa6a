"""The compiled step (TrainConfig.compile, labkit.runtime.step) on the plain CPU, and the XLA path left as it is.

Inductor compiles C++ on the host: measured here on a loaded 2-core machine, ~3.5 min for the tiny GPT's graphs
(cold cache) and 7.7 min for a ResNet of 4 BasicBlocks (about a hundred kernels, forward, backward and eval). So
the GPT runs through Inductor (compiled numerics, checked against eager), and the ResNet through
compile_backend="aot_eager": the same capture (Dynamo's graphs, AOTAutograd's backward, BatchNorm's buffers
updated in the graph, the optimizer's graph, eval mode, checkpoints), with eager kernels; bench/bench_compile.py
times a ResNet through Inductor. Each run is made once per module and shared; the steps are few.

Tolerance, compiled vs eager losses: rtol 1e-4 in fp32 after 6 steps. Not exact: Inductor fuses the ops and
reorders float32 sums (matmul epilogues, LayerNorm, softmax, the optimizer's arithmetic in one kernel), so each
step rounds differently, ~1e-7 relative, and the differences grow with the updates. Compiled vs compiled (a run
resumed from a checkpoint against one that was not): rtol 1e-6, see test_gpt_compiled_resume_is_exact.
"""

from __future__ import annotations

import pytest
import torch
import torchvision

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.lm import LMTrainer
from labkit.models import gpt
from labkit.models.gpt import GPT, GPTConfig
from labkit.runtime.step import CompiledStep, EagerStep, unexpected_breaks

STEPS = 6  # optimizer steps per run
WARMUP = 2  # TrainConfig.warmup_steps: the model's graph at step 1, the optimizer's at step 1 (its state appears)


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass (autograd sizes its device queues at the first one), and
    give this module's compiled models torch.compile's caches to themselves (8 entries per function)."""
    labkit.setup("xla-cpu")
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()  # process-wide: graph breaks other modules planted (tests/test_compile_instruments.py) are not ours
    yield
    torch._dynamo.reset()


def counts() -> dict:
    """torch.compile's own record so far: frames it compiled (each recompile is one), graphs, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
    }


class Record:
    """A callback: each step's counts, and the loss of every log (log_every=1: every step)."""

    def __init__(self):
        self.per_step = []

    def on_step_end(self, trainer, batch):
        self.per_step.append(counts())


def lm_data(n=24, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, T + 1), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


def gpt_run(compile, checkpoint=None, resume=False, max_steps=STEPS):
    """A tiny GPT (1 layer, 32 wide) on random bytes: AdamW with warm-up + cosine (the lr changes every step),
    clipping at 1.0, one loss per log."""
    rt = labkit.setup("cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    opt = gpt.adamw(model, 1e-2, rt=rt)
    sched = labkit.warmup_cosine(opt, warmup=2, total=STEPS)
    loader = torch.utils.data.DataLoader(lm_data(), batch_size=4)
    cfg = labkit.TrainConfig(
        max_steps=max_steps,
        log_every=1,
        clip_norm=1.0,
        compile=compile,
        warmup_steps=WARMUP,
        resume=resume,
        checkpoint_every=3 if checkpoint is not None else 0,
    )
    rec = Record()
    tr = LMTrainer(model, opt, rt, cfg, loader, scheduler=sched, callbacks=[rec], checkpoint=checkpoint)
    tr.fit()
    return tr, rec


def tiny_resnet(dtype=torch.float32):
    """A ResNet with one BasicBlock per stage (torchvision's own class): convs, BatchNorm, residual adds."""
    torch.manual_seed(0)
    return torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10).to(
        dtype
    )


def image_data(n=32, size=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, size, size, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)
    )


def resnet_run(compile):
    """SGD with momentum at a learning rate low enough that the losses stay comparable (with lr 0.05, batch 4 at
    16 px, where the last stage's BatchNorm normalises 4 values, the loss rose to 7 from ln 10 and eager vs
    Inductor parted by 1.5 % at step 4).

    In float64: aot_eager runs BatchNorm as decomposed ops (the variance as a mean of squares, another summation
    order), and where the last stages' BatchNorm normalises 8 values per channel float32's rounding is amplified
    into the loss: measured on one x86 CPU, float32 losses equal for the 2 eager warm-up steps, then 2.8e-4 apart at
    the first compiled step and 4 % apart by the sixth (1.2e-4 on another CPU). In float64 the same runs agree to
    1e-15, so the comparison can be tight and still hold on any CPU."""
    rt = labkit.setup("cpu")
    model = tiny_resnet(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    train = torch.utils.data.DataLoader(image_data(n=8 * STEPS, dtype=torch.float64), batch_size=8)  # one epoch
    evals = torch.utils.data.DataLoader(image_data(n=16, seed=1, dtype=torch.float64), batch_size=8)
    cfg = labkit.TrainConfig(
        max_steps=STEPS, log_every=1, compile=compile, compile_backend="aot_eager", warmup_steps=WARMUP, eval_every=1
    )
    rec = Record()
    tr = labkit.Trainer(model, opt, rt, cfg, train, evals, callbacks=[rec])
    tr.fit()
    return tr, rec


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    eager, _ = gpt_run("off")
    compiled, rec = gpt_run("on", checkpoint=CheckpointManager(str(tmp_path_factory.mktemp("ckpt"))))
    return eager, compiled, rec


@pytest.fixture(scope="module")
def resnet_runs():
    eager, _ = resnet_run("off")
    compiled, rec = resnet_run("on")
    return eager, compiled, rec


def losses(trainer):
    return [h["loss"] for h in trainer.history]


def test_compile_setting_parses_and_names_itself(monkeypatch):
    assert labkit.TrainConfig().compile == "auto" and labkit.TrainConfig().compile_backend == "inductor"
    for given, want in [("on", "on"), (True, "on"), ("YES", "on"), ("off", "off"), (False, "off"), ("Auto", "auto")]:
        assert labkit.TrainConfig(compile=given).compile == want, given
    with pytest.raises(ValueError, match=r"TrainConfig\.compile='maybe'.*auto, on, off"):
        labkit.TrainConfig(compile="maybe")
    with pytest.raises(ValueError, match=r"TrainConfig\.compile_backend"):
        labkit.TrainConfig(compile_backend="")
    monkeypatch.setenv("LABKIT_COMPILE", "on")
    monkeypatch.setenv("LABKIT_COMPILE_BACKEND", "aot_eager")
    cfg = labkit.TrainConfig.from_env()
    assert (cfg.compile, cfg.compile_backend) == ("on", "aot_eager")
    monkeypatch.setenv("LABKIT_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="TrainConfig.compile"):
        labkit.TrainConfig.from_env()


def test_each_runtime_chooses_its_capture():
    cpu = labkit.setup("cpu")
    assert type(cpu.step_capture("auto")) is EagerStep  # the plain CPU: compiling costs more than it gains
    assert type(cpu.step_capture("off")) is EagerStep
    on = cpu.step_capture("on", "tpu")
    assert isinstance(on, CompiledStep) and on.backend == "tpu"
    cuda = labkit.Runtime("cuda", torch.device("cuda", 0))  # the class only: no GPU is touched
    assert type(cuda.step_capture("auto")) is CompiledStep and type(cuda.step_capture("off")) is EagerStep


def test_auto_compiles_when_the_planned_steps_exceed_the_payback(capsys):
    """compile="auto" decides by numbers: the run's planned steps against the kind's PAYBACK_STEPS figure, and says
    which and why in one line; a kind without a figure, or a figure of never, stays eager."""
    from labkit.runtime import step as step_mod

    cuda = labkit.Runtime("cuda", torch.device("cuda", 0))  # the class only: no GPU is touched
    payback = step_mod.PAYBACK_STEPS["cuda"].steps
    assert type(cuda.step_capture("auto", steps=int(payback) + 1)) is CompiledStep
    assert type(cuda.step_capture("auto", steps=int(payback))) is EagerStep
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "-> torch.compile step" in lines[0] and "-> eager step" in lines[1], lines
    assert f"{int(payback) + 1:,} planned steps > {int(payback):,}, the steps" in lines[0]
    assert "estimate" not in lines[0]  # the cuda row is measured
    cpu = labkit.setup("cpu")  # measured there: never pays
    assert type(cpu.step_capture("auto", steps=10**9)) is EagerStep
    assert "on cpu a compiled step never repays its compile time" in capsys.readouterr().out
    assert type(cpu.step_capture("on")) is CompiledStep and capsys.readouterr().out == ""  # only "auto" explains
    odd = labkit.Runtime("cpu", torch.device("cpu"))
    odd.kind = "quantum"
    assert type(odd.step_capture("auto", steps=10**9)) is EagerStep
    assert "no payback figure for 'quantum'" in capsys.readouterr().out


def test_the_cuda_payback_is_the_h200s_measured_figure():
    """The cuda row holds the larger of the two H200 readings (GPT-2 small 2,857 steps, ResNet-50 at batch 128
    5,639), with its conditions: a 3,000-step GPT-2 run stays eager, a 6,000-step run of either compiles."""
    from labkit.runtime import step as step_mod

    row = step_mod.PAYBACK_STEPS["cuda"]
    assert row.steps == max(2_857, 5_639)
    assert not row.source.startswith("not measured")
    for fact in ("H200", "2,857", "5,639", "GPT-2 small", "ResNet-50", "batch 128", "bf16", "torch 2.11"):
        assert fact in row.source, fact
    assert type(step_mod.choose("auto", "inductor", "cuda", 3_000)) is EagerStep
    assert type(step_mod.choose("auto", "inductor", "cuda", 6_000)) is CompiledStep
    assert type(step_mod.choose("auto", "inductor", "cuda", None)) is CompiledStep  # a stream counts as long


def test_planned_steps_read_the_config_and_the_loader():
    from labkit.runtime.step import planned_steps

    loader = list(range(10))  # 10 batches an epoch
    assert planned_steps(labkit.TrainConfig(epochs=3), loader) == 30
    assert planned_steps(labkit.TrainConfig(epochs=3, accum_steps=2), loader) == 15
    assert planned_steps(labkit.TrainConfig(epochs=3, max_steps=7), loader) == 7
    assert planned_steps(labkit.TrainConfig(epochs=3), iter(loader)) is None  # a stream: no length
    assert planned_steps(labkit.TrainConfig(max_steps=5), iter(loader)) == 5
    assert planned_steps(labkit.TrainConfig(), None) is None


def test_xla_keeps_its_lazy_step_and_refuses_on():
    """On XLA the setting is not ignored: "on" is refused (the lazy trace is XLA's compiler); auto/off give the
    step exactly as before: the model object itself and labkit.optimizer_step, nothing wrapped."""
    rt = labkit.setup("xla-cpu")
    with pytest.raises(ValueError, match="compile='on' on XLA"):
        rt.step_capture("on")
    from tests.helpers import small_trainer

    with pytest.raises(ValueError, match="compile='on' on XLA"):
        small_trainer(rt, compile="on")
    for setting in ("auto", "off"):
        tr = small_trainer(rt, compile=setting, max_steps=2)
        assert type(tr.capture) is EagerStep and tr.model is tr.module
        assert tr._optimizer_step is labkit.optimizer_step
        assert all(isinstance(g["lr"], float) for g in tr.optimizer.param_groups)  # prepare() left it alone


def test_gpt_compiled_matches_eager(gpt_runs):
    eager, compiled, _ = gpt_runs
    assert isinstance(compiled.capture, CompiledStep) and compiled.model is not compiled.module
    assert len(losses(compiled)) == STEPS
    torch.testing.assert_close(losses(compiled), losses(eager), rtol=1e-4, atol=0)
    # the compiled step's lr is a float32 tensor (float32 parameters): the same schedule, rounded to float32
    assert [h["lr"] for h in compiled.history] == pytest.approx([h["lr"] for h in eager.history], rel=1e-7)
    assert all(g["lr"].dtype == torch.float32 for g in compiled.optimizer.param_groups)
    # checkpoints hold the plain module's keys, not the compiled wrapper's "_orig_mod." ones
    assert list(compiled.state_dict()["model"]) == list(eager.module.state_dict())


def test_gpt_step_breaks_only_at_torchs_boundaries_and_stops_compiling(gpt_runs):
    _, _, rec = gpt_runs
    first, last = rec.per_step[0], rec.per_step[-1]
    assert first["graphs"] >= 2  # the model's forward + backward, the optimizer's update
    assert last["breaks"], "no graph break at all: torch's own boundaries are expected in the optimizer step"
    assert not unexpected_breaks(last["breaks"]), "graph breaks beyond torch's own boundaries"
    warm = rec.per_step[WARMUP - 1]
    assert (last["frames"], last["graphs"]) == (warm["frames"], warm["graphs"]), "recompiled after warm-up"


def test_gpt_compiled_resume_is_exact(gpt_runs, tmp_path):
    _, compiled, _ = gpt_runs
    ckpt = compiled.checkpoint
    assert ckpt.latest()["step"] == STEPS
    # a second run that stops at step 3 (a checkpoint there), then a new Trainer that resumes it
    part = CheckpointManager(str(tmp_path / "part"))
    first, _ = gpt_run("on", checkpoint=part, max_steps=3)
    resumed, rec = gpt_run("on", checkpoint=part, resume=True)
    assert resumed.step == STEPS and [h["step"] for h in resumed.history] == [4, 5, 6]
    # the same kernels, but not bit for bit: two uninterrupted compiled runs differ too, in the embedding's weight
    # only (measured: 7e-10 at most), whose gradient is a scatter-add that Inductor's CPU code runs in parallel
    torch.testing.assert_close(losses(first) + losses(resumed), losses(compiled), rtol=1e-6, atol=0)
    for (name, a), b in zip(compiled.module.state_dict().items(), resumed.module.state_dict().values()):
        if name.endswith("attn.qkv.bias"):
            # the key third's gradient is zero in exact arithmetic (softmax ignores a shift that is the same for
            # every key), so it is rounding noise alone, and AdamW divides it by its own root mean square: noise
            # of 1e-10 moves those entries by up to lr per step. Compare the query and value thirds only.
            q, _, v = a.chunk(3)
            a, b = torch.cat([q, v]), torch.cat([b.chunk(3)[0], b.chunk(3)[2]])
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert not unexpected_breaks(rec.per_step[-1]["breaks"])


def test_resnet_compiled_matches_eager_with_buffers_and_eval(resnet_runs):
    eager, compiled, rec = resnet_runs
    # float64 (resnet_run says why): measured 1e-15 apart; a lost buffer update, momentum or gradient scale is 1e-3+
    torch.testing.assert_close(losses(compiled), losses(eager), rtol=1e-10, atol=0)
    assert all(g["lr"].dtype == torch.float64 for g in compiled.optimizer.param_groups)  # float64 parameters
    # BatchNorm's running statistics are updated inside the compiled graph, on the module checkpoints save
    for (name, a), b in zip(eager.module.state_dict().items(), compiled.module.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=f"after {STEPS} steps: {name}")
    (ev,), (cv,) = eager.eval_history, compiled.eval_history
    assert cv["val_loss"] == pytest.approx(ev["val_loss"], rel=1e-10) and cv["val_acc"] == ev["val_acc"]
    warm, last = rec.per_step[WARMUP - 1], rec.per_step[-1]
    assert last["frames"] == warm["frames"], "recompiled after warm-up"
    assert not unexpected_breaks(last["breaks"])
    assert compiled.state_dict()["model"].keys() == eager.module.state_dict().keys()


def test_the_readme_quotes_each_payback_row():
    """The README's table "When compile='auto' compiles" gives the measured rows' figures (cpu, cuda) as PAYBACK_STEPS
    holds them, and so does any other row it lists."""
    import math
    import re
    from pathlib import Path

    from labkit.runtime import step as step_mod

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for kind, row in step_mod.PAYBACK_STEPS.items():
        line = re.search(rf"^\| `{kind}` \| ([^|]+) \|", readme, re.M)
        assert line or kind not in ("cpu", "cuda"), f"no README row for {kind!r}"
        if line is None:
            continue
        want = "never" if math.isinf(row.steps) else f"{row.steps:,.0f}"
        assert want in line.group(1), (kind, line.group(1), want)
