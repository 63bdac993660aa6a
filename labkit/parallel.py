"""How a model is laid out over torchrun's processes: one object per plan, chosen once per run.

    plan = labkit.parallel.choose(rt, "auto", precision)   # TrainConfig.parallel: auto | replicate | fsdp2
    model = plan.wrap(model, optimizer)                     # DDP, fully_shard per block then the root, or as is
    with plan.gradient_sync(last_micro_batch): loss.backward()   # accumulation: only the last one reduces
    state = plan.model_state(model); plan.load_model_state(model, state)   # plain keys, whatever the plan
    with collective_counter() as c: ...; labkit.spmd.dtensor_plans.comm_counts(c)   # what a step issued

The Trainer asks for a plan the way it asks its runtime for a step capture (rt.step_capture): it calls the plan's
methods and never asks which one runs. Three plans:

- `Single`: one process, or XLA's replicas (they reduce in optimizer_step) and SPMD (the compiler inserts the
  collectives): the model as it is.
- `Replicate` ("replicate"): DistributedDataParallel, each process a whole copy; gradients all-reduced in backward.
- `FullyShard` ("fsdp2"): torch.distributed.fsdp.fully_shard (FSDP2) on each unit (the GPT's transformer blocks, a
  ResNet's four stages), then on the root. Every parameter becomes a DTensor Shard(0) over the processes; forward
  all-gathers a unit, uses it and frees it (torch 2.9's default reshard_after_forward: True below the root, False at
  it); backward gathers each block again and reduce-scatters its gradients. Under bf16:
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the gathered weights are bf16, the kept shards, the
  gradient reduction and AdamW's state fp32.

"auto" under torchrun picks by what fits: weights + gradients + AdamW's two moments (labkit.spmd.comm.fits: 16 bytes
a float32 weight) of a whole copy on each device, against half of one device's memory (the other half for
activations, the batch and the allocator's slack); replicate where that fits, fsdp2 where it does not.

Gradient accumulation (TrainConfig.accum_steps = k): `gradient_sync(False)` for the first k-1 micro-batches keeps
their gradients on each process (DDP's no_sync(); FSDP2's set_requires_gradient_sync(False)), so the gradient
reduction runs once per optimizer step, as with k = 1. Under FSDP2 those micro-batches also keep the weights gathered
(set_reshard_after_forward(False) on the units, set_reshard_after_backward(False)): the first forward gathers each
unit once and nothing is gathered again until the last micro-batch, whose backward gathers the units as k = 1's does.
Counted (tests/test_fsdp_trainer.py, 2 blocks): 5 all-gathers, 3 reduce-scatters, 1 all-reduce per optimizer step at
k = 1 and at k = 4 (20 all-gathers at k = 4 before). The price is memory, for the whole accumulation window: every
process holds the whole model's gathered weights (in the gather dtype) and its whole unreduced gradients, as DDP
does, only AdamW's state staying sharded. Where that does not fit, accumulation under FSDP2 is not the tool.

State: FSDP2's parameters are DTensors; `model_state` / `optimizer_state` are torch.distributed.checkpoint's
get_model_state_dict / get_optimizer_state_dict (keys as the plain model names them: "blocks.0.attn.qkv.weight",
the optimizer's by parameter name), so labkit.checkpoint writes each process's shards with DCP and a run on
another number of processes reads them back (DCP reshards).
"""

from __future__ import annotations

import contextlib
import os

import torch

from labkit.config import PARALLEL as PLANS
from labkit.spmd.comm import fits
from labkit.spmd.dtensor_plans import collective_bytes, op_name

STATE_BYTES_PER_WEIGHT = 16  # float32 weight 4 + gradient 4 + AdamW's two moments 8 (labkit.spmd.comm.fits)


class Single:
    """One process (or XLA's own replication): nothing to wrap, nothing to sync."""

    name = "single"

    def wrap(self, model, optimizer):
        return model

    def gradient_sync(self, enabled: bool):
        """A context for one micro-batch's forward + backward: enabled=False keeps its gradients local."""
        return contextlib.nullcontext()

    def model_state(self, module) -> dict:
        return module.state_dict()

    def load_model_state(self, module, state: dict) -> None:
        module.load_state_dict(state)

    def optimizer_state(self, module, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, module, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Replicate(Single):
    """DistributedDataParallel: a whole copy per process, gradients all-reduced (averaged) in backward."""

    name = "replicate"

    def __init__(self, rt):
        self.rt, self.ddp = rt, None

    def wrap(self, model, optimizer):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.ddp = model
        else:
            self.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=self.rt.ddp_device_ids())
        return self.ddp

    def gradient_sync(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.ddp.no_sync()

    def describe(self) -> str:
        return f"replicate (DDP) over {self.rt.world_size} processes"


def units(model) -> list:
    """The submodules FSDP2 shards as units of their own, before the root: model.fsdp_units() if it has one, the
    GPT's transformer blocks, a (torchvision) ResNet's four stages; [] otherwise (the root alone: one unit)."""
    if callable(getattr(model, "fsdp_units", None)):
        return list(model.fsdp_units())
    if isinstance(getattr(model, "blocks", None), torch.nn.ModuleList):
        return list(model.blocks)
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    return stages if all(isinstance(s, torch.nn.Module) for s in stages) else []


class FullyShard(Single):
    """FSDP2: fully_shard on each unit (labkit.parallel.units), then the root, over all torchrun processes."""

    name = "fsdp2"

    def __init__(self, rt, precision=None):
        self.rt, self.precision, self.root, self.mesh, self.units = rt, precision, None, None, []

    def mixed_precision(self):
        """MixedPrecisionPolicy(bf16 gathers, fp32 reduction) under bf16, else None (everything float32)."""
        if self.precision is None or self.precision.dtype is not torch.bfloat16:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def wrap(self, model, optimizer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if optimizer is not None and optimizer.state:
            raise ValueError(
                "parallel='fsdp2': the optimizer already holds state (it has stepped, or a state was loaded); FSDP2 "
                "replaces the parameters with sharded ones, so build the optimizer fresh and let the Trainer (or "
                "labkit.checkpoint) restore its state"
            )
        self.mesh = init_device_mesh(self.rt.device.type, (self.rt.world_size,), mesh_dim_names=("fsdp",))
        kw = {"mesh": self.mesh}
        if self.mixed_precision() is not None:
            kw["mp_policy"] = self.mixed_precision()
        before = dict(model.named_parameters())
        self.units = units(model)
        for unit in self.units:
            fully_shard(unit, **kw)
        self.root = fully_shard(model, **kw)
        after = dict(model.named_parameters())  # the same names, new Parameter objects (DTensors)
        swap = {id(before[n]): after[n] for n in before if n in after}
        if optimizer is not None:  # an optimizer built on the plain model now steps the shards
            for group in optimizer.param_groups:
                group["params"] = [swap.get(id(p), p) for p in group["params"]]
        return self.root

    def gradient_sync(self, enabled: bool):
        """enabled=False (a micro-batch before the last): no reduce-scatter (the gradients add up unsharded), and the
        weights, once gathered, stay gathered: no reshard after the units' forward nor after backward, so the next
        micro-batches gather nothing. enabled=True (the last, or k = 1): torch's defaults again, so its forward
        frees each unit, its backward gathers it again, reduce-scatters and reshards: k = 1's collectives."""
        self.root.set_requires_gradient_sync(enabled)  # read at backward: reduce-scatter now, or keep adding up
        self.root.set_reshard_after_backward(enabled)
        for unit in self.units:  # the root keeps its own default (no reshard after forward)
            unit.set_reshard_after_forward(enabled, recurse=False)
        return contextlib.nullcontext()

    def model_state(self, module) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module)  # DTensors under the plain names

    def load_model_state(self, module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, state)

    def optimizer_state(self, module, optimizer) -> dict:
        """The optimizer's state keyed by parameter name, as DTensors. torch creates an empty optimizer's state with
        one step of zero gradients at lr 0 to get it; that state is dropped again here (it stays in the returned
        dict as a template to restore into), so a run that restores nothing trains exactly as one never asked."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not optimizer.state
        state = get_optimizer_state_dict(module, optimizer)
        if fresh:
            optimizer.state.clear()
        return state

    def load_optimizer_state(self, module, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, state)

    def describe(self) -> str:
        mp = " (bf16 gathers, fp32 reduction)" if self.mixed_precision() is not None else ""
        return f"fsdp2 over {self.rt.world_size} processes{mp}"


def device_memory(rt) -> int | None:
    """Bytes one process may use: the accelerator's memory, or on the CPU the host's RAM shared by its processes."""
    mem = rt.memory() or {}
    if mem.get("limit"):
        return int(mem["limit"])
    if rt.device.type == "cuda":
        return int(torch.cuda.get_device_properties(rt.device).total_memory)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return ram // max(1, local)


def auto_plan(params: int, memory: int | None, devices: int) -> str:
    """ "replicate" when a whole copy's weights, gradients and AdamW state fit half of `memory`, else "fsdp2"."""
    if memory is None:
        return "replicate"
    return "replicate" if fits(params, memory / 2, devices, "data", STATE_BYTES_PER_WEIGHT) else "fsdp2"


def check_setting(setting) -> str:
    if setting not in PLANS:
        raise ValueError(f"TrainConfig.parallel={setting!r}: expected one of {', '.join(PLANS)}")
    return setting


def choose(rt, setting: str = "auto", precision=None, model=None) -> Single:
    """The plan for TrainConfig.parallel on this runtime. Several torch.distributed processes (rt.uses_ddp and
    world_size > 1): "replicate", "fsdp2", or "auto" by what fits (model: to count its parameters). One process,
    XLA and SPMD: Single ("auto"); asking them for replicate or fsdp2 is refused by name."""
    check_setting(setting)
    torchrun = rt.uses_ddp and rt.world_size > 1
    if not torchrun:
        if setting != "auto":
            where = f"world size {rt.world_size}" if rt.uses_ddp else f"the {rt.kind} runtime (spmd={rt.spmd})"
            raise ValueError(
                f"TrainConfig.parallel={setting!r} needs torchrun with 2 or more processes of torch.distributed "
                f"(cpu/gloo or cuda/nccl); this run has {where}. Use parallel='auto' here, or launch with "
                "`torchrun --nproc-per-node N -m labkit.train ...`"
            )
        return Single()
    if setting == "auto":
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        setting = auto_plan(params, device_memory(rt), rt.world_size)
    if setting == "fsdp2":
        if precision is not None and precision.needs_scaler:
            raise ValueError(
                "parallel='fsdp2' with fp16: the GradScaler of labkit.precision does not handle sharded gradients; "
                "use bf16 (MixedPrecisionPolicy) or fp32 under FSDP2, or parallel='replicate'"
            )
        return FullyShard(rt, precision)
    return Replicate(rt)


def collective_counter():
    """comm_mode() without CommDebugMode's module tracker (its hooks fail on a module entered before the mode, e.g.
    a DistributedDataParallel forward): every c10d / functional collective counted. Read comm_counts(mode) after."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        counts: dict[str, int]
        bytes_by_op: dict[str, int]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs first and turns the op into plain ones and collectives, seen here
            out = func(*args, **(kwargs or {}))
            if func.namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(("wait", "barrier")):
                name = op_name(func._overloadpacket)
                self.counts[name] = self.counts.get(name, 0) + 1
                self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + collective_bytes(args, out)
            return out

        def get_comm_counts(self) -> dict:
            return dict(self.counts)

    mode = _Count()
    mode.counts, mode.bytes_by_op = {}, {}
    return mode
