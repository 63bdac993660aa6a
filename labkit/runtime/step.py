"""How a training step is captured: as written (eager, or torch_xla's lazy trace) or with torch.compile.

    capture = rt.step_capture(cfg.compile, cfg.compile_backend)   # an EagerStep or a CompiledStep
    capture.prepare(optimizer)            # compiled: a tensor lr, capturable state on the device (idempotent)
    model = capture.model(model)          # compiled: torch.compile(model, dynamic=False, backend=...)
    step = capture.function(labkit.optimizer_step)   # compiled: the optimizer step as its own graphs
    loss = loss_fn(model(x), y); loss.backward(); step(optimizer, rt); optimizer.zero_grad()

The Trainer asks its runtime for one of these and calls it the same way on every backend: no hook asks which
engine runs. XLA's runtimes always give `EagerStep` (torch_xla records the step and compiles it at
`rt.sync()`; TrainConfig.compile="on" is refused there). compile="auto" compiles where the run's planned steps
exceed the compile's payback on that kind of device (PAYBACK_STEPS below: measured, or an estimate until measured). The backend is one argument: "inductor" on CPU and CUDA, "tpu" for TorchTPU
(its guide: `torch.compile(backend="tpu", dynamic=False)`), "aot_eager" to test the capture without codegen.

Which graphs a compiled step is made of, in torch 2.9, and why there:
1. the model's forward and backward: one Dynamo graph of the forward, which AOTAutograd splits into a forward
   and a backward compiled together. The loss is computed in it when the model returns it (the GPT), or eagerly
   right after it (a loss_fn outside the model: a few ops). `loss.backward()` itself is called outside: inside
   a compiled function it is a graph break (Dynamo traces Tensor.backward only with compiled autograd on,
   `torch._dynamo.config.compiled_autograd`), so the model, not the step, is what gets compiled, and its backward
   comes from AOTAutograd.
2. the optimizer step: torch breaks it on purpose, and each of those breaks is one row of
   labkit.runtime.boundaries.TORCH_BOUNDARIES (listed at the end of this docstring, keyed on torch's graph-break
   registry ids): `Optimizer.step` breaks around itself (`_use_grad` calls `torch._dynamo.graph_break()`, so that
   the update is compiled as an inference graph), and Dynamo does not trace the call into a step that an LR
   scheduler wrapped: those two leave the update as one graph of its own. With clip_norm set, clip_grad_norm_'s
   grouping of the gradients by device and dtype (a call that returns a dict) is one more: the norm and the
   scaling are graphs around it. Under fp16 Dynamo skips the GradScaler's unscale_/step/update (its inf check
   reads a value on the host: a host sync per step, as in eager). `fullgraph=True` would raise on them, so it is
   not used.
Everything else (zero_grad, the scheduler's step, the loss sums) stays eager: a few small ops per step.

Recompiles: `dynamic=False` specialises each graph to its shapes, so a new batch shape is a new graph (as on
XLA). A learning rate that changes as a Python float is a guard that fails every step; `prepare` turns each
param group's lr into a 0-dim CPU tensor (float32, or float64 for float64 parameters: lr_dtype; what torch's
"compiled optimizer with an LR scheduler" recipe does; LambdaLR and the other schedulers then fill it in place; the
compiled step puts it back where a scheduler assigned a float, as ReduceLROnPlateau and CosineAnnealingWarmRestarts
do), and, off the CPU, sets `capturable=True` on optimizers
that have it (Adam, AdamW, ...): their step counts live on the device, so the bias corrections are tensors in the
graph, not host floats (Dynamo sets it too, but only before the state exists: not after a resume). After
warm-up (the first step: the model's graph; the optimizer's graph, once its state exists) a run compiles
nothing new; evaluation compiles its own graph once (eval mode, no grad).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit.runtime.boundaries import BY_ID, docs_table, gb_id

if __doc__:  # None under python -OO
    __doc__ += "\ntorch's own boundaries (labkit.runtime.boundaries):\n" + docs_table() + "\n"


def unexpected_breaks(reasons) -> list[str]:
    """The graph-break reasons (counters["graph_break"]'s keys: torch's whole message) whose registry id is none of
    torch's own boundaries. The id only: these keys carry no file, so this is a screen for tests of a step whose
    code is known; labkit.dashboard.dynamo's record, which has the file, is what decides whose a break is."""
    return [r for r in reasons if gb_id(r, r) not in BY_ID]


def lr_dtype(group) -> torch.dtype:
    """The dtype of a param group's tensor lr: float64 where its parameters are float64, else float32 (torch's
    recipe, `lr=torch.tensor(0.01)`). A float64 lr in a float32 update is a `const double*` input of Inductor's fused
    AdamW kernel (torch 2.9, CPU): the step size and eps terms, recomputed for each 16 lanes, then run in double with
    two conversions, where a float lr is a float constant; the rest of the kernel is the same. Measured (2026-11-27,
    the GPT of bench/bench_compile.py, its compiled AdamW step alone, CPU seconds on one thread, 12 interleaved
    rounds of a loaded 2-core x86 machine): 2.27 ms with a float64 lr, 2.08 ms float32, 2.03 ms a float constant."""
    return torch.float64 if any(p.dtype == torch.float64 for p in group["params"]) else torch.float32


class EagerStep:
    """The step as written: each op runs as Python calls it (CPU, CUDA), or is recorded for rt.sync() (XLA)."""

    compiled = False
    backend = None

    def model(self, model):
        return model

    def function(self, fn):
        return fn

    def prepare(self, optimizer) -> None:
        """Nothing to change: an eager optimizer takes Python floats and its own capturable setting."""

    def __repr__(self) -> str:
        return "EagerStep()"


class CompiledStep(EagerStep):
    """torch.compile of the model (forward + backward through AOTAutograd) and of the optimizer step."""

    compiled = True

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self._lr: dict = {}  # id(param group) -> its 0-dim lr tensor (keep_tensor_lr)

    def model(self, model):
        """The compiled module: it shares the model's parameters and buffers, and its state_dict's keys gain an
        `_orig_mod.` prefix, so checkpoints keep saving and loading the original module (Trainer.module)."""
        return torch.compile(model, dynamic=False, backend=self.backend)

    def function(self, fn):
        """fn compiled; called with an optimizer first (labkit.optimizer_step), it first puts back the tensor lr
        that a scheduler may have replaced with a float (keep_tensor_lr)."""
        compiled = torch.compile(fn, dynamic=False, backend=self.backend)

        def call(*args, **kwargs):
            if args and isinstance(args[0], torch.optim.Optimizer):
                self.keep_tensor_lr(args[0])
            return compiled(*args, **kwargs)

        return call

    def keep_tensor_lr(self, optimizer) -> None:
        """Each param group's lr as its 0-dim tensor. Most schedulers fill that tensor in place; ReduceLROnPlateau
        and CosineAnnealingWarmRestarts (torch 2.9) assign a new value instead (a Python float: a guard that fails at
        every change, a recompile of the update each time): the value is copied into the group's own tensor, which
        goes back in its place. Once per step, a few host-side assignments."""
        for group in optimizer.param_groups:
            lr, own = group["lr"], self._lr.get(id(group))
            if lr is own:
                continue
            if own is None:  # the first look at this group: its tensor from now on
                own = self._lr[id(group)] = (
                    lr if torch.is_tensor(lr) else torch.tensor(float(lr), dtype=lr_dtype(group))
                )
            else:  # a float, or another tensor a scheduler computed: its value into the group's own (on the CPU)
                own.fill_(float(lr))
            group["lr"] = own

    def prepare(self, optimizer) -> None:
        """A 0-dim tensor lr in every param group (a float lr that a scheduler changes is a recompile per step);
        off the CPU, capturable=True where the optimizer has it, with its step counts moved to the parameters'
        device. Run again after optimizer.load_state_dict (a checkpoint brings its own param groups)."""
        self.keep_tensor_lr(optimizer)
        for group in optimizer.param_groups:
            on_device = all(p.device.type != "cpu" for p in group["params"])
            if "capturable" in group and on_device and not group["capturable"]:
                group["capturable"] = True
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    if torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                        state["step"] = state["step"].to(p.device, torch.float32)

    def __repr__(self) -> str:
        return f"CompiledStep(backend={self.backend!r})"


@dataclass(frozen=True)
class Payback:
    """How many steps a torch.compile'd step takes to repay its compile on one kind of device: the compile's seconds
    over the seconds it saves per step (bench/bench_compile.py prints it as PAYBACK). inf: compiled is no faster."""

    steps: float
    source: str  # measured where, when and how loaded; or "not measured" and what the estimate rests on


# One row per runtime kind (Runtime.kind), read by TrainConfig(compile="auto"): it compiles when the run's planned
# steps exceed the row's figure. The README's table ("When compile='auto' compiles") quotes these rows.
PAYBACK_STEPS = {
    "cpu": Payback(
        math.inf,
        "measured 2026-11-26, bench/bench_compile.py --device cpu (GPT 2x128, T=128, batch 8, fp32, inductor) on a "
        "shared 2-core x86 machine at load ~10: compiled 1.11x the eager step after a 390 s compile, so it never pays "
        "(quiet, 2026-11-27, load 0.15, 5 trials of 20 steps: 0.896x after a 41 s compile, payback 7,440 steps; an "
        "earlier reading of a 3.3 M GPT step: 0.85x after 97 s). It stays never: a busy machine never repays it",
    ),
    "cuda": Payback(
        5_639,
        "measured 2026-11-28, bench/bench_compile.py --device cuda --size gpt2 on one NVIDIA H200 (torch 2.11.0+cu130, "
        "bf16 autocast, Inductor): GPT-2 small (T=1024, batch 16) repays its ~42 s compile in 2,857 steps, "
        "ResNet-50 (224 px, batch 128) its ~56 s compile in 5,639; the row keeps the larger, so that auto "
        "compiles only runs that repay it for both (a GPT-2 run between the two stays eager and forgoes less than one "
        "compile's time)",
    ),
    "torch-tpu": Payback(
        0,
        "not measured: no TPU chip here. TorchTPU runs eagerly op by op, each op a launch of its own on the chip, and "
        "its guide trains with torch.compile(backend='tpu', dynamic=False); auto compiles every run there",
    ),
}


def planned_steps(cfg, loader) -> int | None:
    """The optimizer steps a run plans: epochs x len(loader) // accum_steps, capped by max_steps; None when the loader
    has no length and no max_steps caps it (a stream)."""
    try:
        per_epoch = len(loader) // cfg.accum_steps if loader is not None else None
    except TypeError:  # an IterableDataset without __len__
        per_epoch = None
    total = cfg.epochs * per_epoch if per_epoch is not None else None
    if cfg.max_steps:
        return min(total, cfg.max_steps) if total is not None else cfg.max_steps
    return total


def choose(setting: str, backend: str, kind: str = "cpu", steps: int | None = None, log=None) -> EagerStep:
    """The capture for TrainConfig.compile's `setting` ("auto" | "on" | "off") on a runtime of this `kind`. "auto"
    compiles when the run's planned `steps` exceed the kind's PAYBACK_STEPS figure (unknown steps: a long run, so
    wherever the figure is finite), and says once through `log` which it chose and why."""
    if setting != "auto":
        return CompiledStep(backend) if setting == "on" else EagerStep()
    row = PAYBACK_STEPS.get(kind)
    if row is None:
        compile, why = False, f"no payback figure for {kind!r} in labkit.runtime.step.PAYBACK_STEPS"
    else:
        estimate = " (an estimate, not measured)" if row.source.startswith("not measured") else ""
        plan = f"{steps:,} planned steps" if steps is not None else "a run of unknown length"
        compile = steps > row.steps if steps is not None else math.isfinite(row.steps)
        if math.isinf(row.steps):
            why = f"on {kind} a compiled step never repays its compile time{estimate}, whatever the length ({plan})"
        else:
            why = f"{plan} {'>' if compile else '<='} {row.steps:,.0f}, the steps a compiled step takes to repay its "
            why += f"compile time on {kind}{estimate}"
    if log is not None:
        log(f"labkit: compile='auto' -> {'torch.compile' if compile else 'eager'} step: {why}")
    return CompiledStep(backend) if compile else EagerStep()
