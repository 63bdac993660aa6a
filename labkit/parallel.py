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

from labkit import meta_init
from labkit.config import PARALLEL as PLANS
from labkit.spmd.comm import fits
from labkit.spmd.dtensor_plans import collective_bytes, op_name

STATE_BYTES_PER_WEIGHT = 16  # float32 weight 4 + gradient 4 + AdamW's two moments 8 (labkit.spmd.comm.fits)


class PlanError(ValueError):
    """A parallel setting this run cannot use (a flag, LABKIT_PARALLEL or TrainConfig.parallel): `python -m
    labkit.train` prints it as one line naming the setting, exit 2, no traceback."""


def _repoint(optimizer, before: dict, model) -> None:
    """The optimizer's parameters swapped, by name, for the model's current ones (fully_shard and to_empty may
    replace the Parameter objects an optimizer built earlier holds)."""
    after = dict(model.named_parameters())
    swap = {id(before[n]): after[n] for n in before if n in after}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]


def _materialize(model, optimizer, device) -> None:
    before = dict(model.named_parameters())
    meta_init.materialize(model, device)
    _repoint(optimizer, before, model)


def _param_names(module, optimizer) -> list:
    """The optimizer's parameters in its own order (param_groups, as optimizer.state_dict() numbers them), each by
    the module's name for it."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names.get(id(p), str(i)) for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]


def _renumber(state: dict, key) -> dict:
    groups = [dict(g, params=[key(p) for p in g["params"]]) for g in state.get("param_groups", [])]
    return {**state, "state": {key(k): v for k, v in state.get("state", {}).items()}, "param_groups": groups}


def optimizer_by_name(state: dict, module, optimizer) -> dict:
    """An optimizer state keyed by parameter position (torch's optimizer.state_dict(), a one-file checkpoint) turned
    into the form keyed by parameter name that torch.distributed.checkpoint's set_optimizer_state_dict reads; a
    state already keyed by name is returned as it is."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    if not params or not all(isinstance(p, int) for p in params):
        return state
    names = _param_names(module, optimizer)
    return _renumber(state, lambda i: names[i])


def optimizer_by_id(state: dict, module, optimizer) -> dict:
    """The other way: a state keyed by parameter name (a DCP checkpoint of an FSDP2 run) into the positions
    optimizer.load_state_dict reads; a state already keyed by position is returned as it is."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    if not params or not all(isinstance(p, str) for p in params):
        return state
    where = {n: i for i, n in enumerate(_param_names(module, optimizer))}
    unknown = sorted(set(params) - set(where))
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state names parameters this model lacks: {unknown[:3]}")
    return _renumber(state, lambda n: where[n])


def _batchnorms(model) -> list:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _plain(state: dict) -> bool:
    """Whether a model or optimizer state holds whole tensors only (a one-file checkpoint), no DTensor shard."""
    from torch.distributed.tensor import DTensor

    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, DTensor):
            return False
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return True


class Single:
    """One process (or XLA's own replication): nothing to wrap, nothing to sync."""

    name = "single"

    def __init__(self, rt=None):
        self.rt = rt

    def wrap(self, model, optimizer):
        """The model laid out for this plan; one built on the meta device (labkit.meta_init) given memory first."""
        if meta_init.is_meta(model):
            _materialize(model, optimizer, self.rt.device)
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
        optimizer.load_state_dict(optimizer_by_id(state, module, optimizer))  # a DCP checkpoint's is by name

    def sync_buffers(self, module) -> None:
        """Make every process's buffers (BatchNorm's running statistics) equal: nothing to do with one process."""

    def per_process(self, key: str, value) -> dict:
        """{key + "_by_process": {"process<r>": every process's value}} for what differs per process (its RNG), so
        that a DCP checkpoint, which keeps one copy of an entry every process saves, keeps all of them; {} here."""
        return {}

    def lockstep(self, batches, spare=None):
        """(batch, real) for each batch: with one process every batch is real (see Processes.lockstep)."""
        for batch in batches:
            yield batch, True

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Processes(Single):
    """What every plan over several torchrun processes shares: buffers made equal, evaluation in step."""

    def __init__(self, rt):
        super().__init__(rt)
        self._cpu = None

    def sync_buffers(self, module) -> None:
        broadcast_buffers(module)

    def per_process(self, key: str, value) -> dict:
        import torch.distributed as dist

        every = [None] * self.rt.world_size
        dist.all_gather_object(every, value, group=_cpu_group(self))
        return {f"{key}_by_process": {f"process{r}": v for r, v in enumerate(every)}}

    def lockstep(self, batches, spare=None):
        """(batch, real) until EVERY process is out of batches: a process whose share ran out first gets (its last
        batch, or `spare`, False), a forward that keeps its collectives in step with the others and counts nothing.
        Evaluation shards rarely split evenly over the processes, and under FSDP2 each forward all-gathers: the
        process with one batch more would wait in an all-gather while the others wait in the metrics' all-reduce,
        for ever. Before each batch the processes agree whether any still has one: one all-reduce (MAX) of a
        4-byte flag over the CPU (gloo): the cost of the step vote (labkit.interrupts.StepVote) per evaluation batch."""
        import torch.distributed as dist

        group = _cpu_group(self)
        it, last = iter(batches), spare
        while True:
            batch = next(it, None)
            flag = torch.tensor([batch is not None], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if not flag.item():
                return
            if batch is not None:
                last = batch
                yield batch, True
            elif last is None:
                raise RuntimeError(
                    f"evaluation: process {self.rt.ordinal} of {self.rt.world_size} has no evaluation batch at all "
                    "while others do, and no training batch to run the padding forwards with: give every process at "
                    "least one evaluation batch (fewer processes, or more evaluation shards)"
                )
            else:
                yield last, False


class Replicate(Processes):
    """DistributedDataParallel: a whole copy per process, gradients all-reduced (averaged) in backward."""

    name = "replicate"

    def __init__(self, rt):
        super().__init__(rt)
        self.ddp = None

    def wrap(self, model, optimizer):
        model = super().wrap(model, optimizer)  # a meta-built model: each process a whole copy, as DDP needs
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.ddp = model
        else:
            self.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=self.rt.ddp_device_ids())
        return self.ddp

    def gradient_sync(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.ddp.no_sync()

    def describe(self) -> str:
        return f"replicate (DDP) over {self.rt.world_size} processes"


def _cpu_group(plan):
    """A gloo group over every process for the plan's small CPU votes: the default group where it is gloo, else
    one made once per plan (dist.new_group is itself collective: every process makes it at the same call)."""
    import torch.distributed as dist

    if plan._cpu is None:
        plan._cpu = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return plan._cpu


def broadcast_buffers(module) -> None:
    """Every buffer (BatchNorm's running mean, variance and batch count) sent from process 0 to the others, joined
    into one broadcast per dtype (a ResNet-50's 159 buffers, 0.2 MB, in two). Each process updates its running
    statistics from its own batches, so without this they drift apart: each process would evaluate with its own,
    and a checkpoint would keep whichever copy DCP's de-duplication picks. DDP sends process 0's buffers at each
    training forward (broadcast_buffers=True), so after this both plans evaluate and save process 0's statistics.
    The Trainer calls it before every evaluation and save; every process must call it (a collective)."""
    import torch.distributed as dist

    by_dtype: dict = {}
    for b in module.buffers():
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    for bufs in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in bufs])
        dist.broadcast(flat, src=0)
        for b, part in zip(bufs, flat.split([b.numel() for b in bufs])):
            b.data.copy_(part.view_as(b))


def units(model) -> list:
    """The submodules FSDP2 shards as units of their own, before the root: model.fsdp_units() if it has one, the
    GPT's transformer blocks, a (torchvision) ResNet's four stages; [] otherwise (the root alone: one unit)."""
    if callable(getattr(model, "fsdp_units", None)):
        return list(model.fsdp_units())
    if isinstance(getattr(model, "blocks", None), torch.nn.ModuleList):
        return list(model.blocks)
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    return stages if all(isinstance(s, torch.nn.Module) for s in stages) else []


class FullyShard(Processes):
    """FSDP2: fully_shard on each unit (labkit.parallel.units), then the root, over all torchrun processes."""

    name = "fsdp2"

    def __init__(self, rt, precision=None, accumulate: str = "auto", accum_steps: int = 1, hsdp: bool = False):
        super().__init__(rt)
        self.precision, self.root, self.mesh, self.units = precision, None, None, []
        self.accumulate, self.accum_steps, self.hsdp, self.said = accumulate, accum_steps, hsdp, ""
        self.hosts = hosts(rt) if hsdp else 1
        if hsdp:
            self.name = "hsdp"

    def make_mesh(self):
        """fsdp2: one dimension over every process. hsdp: (hosts, processes per host) named ("replicate", "shard"):
        fully_shard on a 2-D mesh shards within a host (its all-gathers and reduce-scatters never leave it) and
        replicates across hosts (one all-reduce of each process's gradient shard per step crosses them)."""
        from torch.distributed.device_mesh import init_device_mesh

        if not self.hsdp:
            return init_device_mesh(self.rt.device.type, (self.rt.world_size,), mesh_dim_names=("fsdp",))
        local = self.rt.world_size // self.hosts
        return init_device_mesh(self.rt.device.type, (self.hosts, local), mesh_dim_names=("replicate", "shard"))

    def mixed_precision(self):
        """MixedPrecisionPolicy(bf16 gathers, fp32 reduction) under bf16, else None (everything float32)."""
        if self.precision is None or self.precision.dtype is not torch.bfloat16:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def batchnorm_precision(self):
        """BatchNorm under a bf16 policy: its weight and bias gathered in float32 (its running statistics are
        float32 buffers, which FSDP2 never casts), and its bf16 input left as it comes (cast_forward_inputs=False):
        torch's batch_norm takes a bf16 input with float32 parameters and statistics (CPU and cuDNN alike), but not
        bf16 parameters with float32 statistics, the error "expected scalar type BFloat16 but found Float" that a
        single bf16 policy over a ResNet gives at its first BatchNorm. The cost: each BatchNorm is a unit of its own,
        so one small all-gather in forward, one in backward and one small reduce-scatter per BatchNorm and step
        (53 of each in ResNet-50): latency, a few KB each, not bandwidth."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def wrap(self, model, optimizer):
        from torch.distributed.fsdp import fully_shard

        if optimizer is not None and optimizer.state:
            raise ValueError(
                "parallel='fsdp2': the optimizer already holds state (it has stepped, or a state was loaded); FSDP2 "
                "replaces the parameters with sharded ones, so build the optimizer fresh and let the Trainer (or "
                "labkit.checkpoint) restore its state"
            )
        self.mesh = self.make_mesh()
        kw = {"mesh": self.mesh}
        if self.mixed_precision() is not None:
            kw["mp_policy"] = self.mixed_precision()
        before = dict(model.named_parameters())
        self.accumulate, self.said = accumulation(self, sum(p.numel() for p in before.values()))
        self.units = units(model)
        if "mp_policy" in kw:  # BatchNorm keeps float32 weights: its own unit, gathered in float32
            for bn in _batchnorms(model):
                fully_shard(bn, mesh=self.mesh, mp_policy=self.batchnorm_precision())
        for unit in self.units:
            fully_shard(unit, **kw)
        self.root = fully_shard(model, **kw)
        _repoint(optimizer, before, model)  # an optimizer built on the plain model now steps the shards
        if meta_init.is_meta(model):  # built on the meta device: only now, sharded, does each process get memory
            _materialize(model, optimizer, self.rt.device)
        return self.root

    def gradient_sync(self, enabled: bool):
        """enabled=False (a micro-batch before the last): no reduce-scatter (the gradients add up unsharded), and the
        weights, once gathered, stay gathered: no reshard after the units' forward nor after backward, so the next
        micro-batches gather nothing. enabled=True (the last, or k = 1): torch's defaults again, so its forward
        frees each unit, its backward gathers it again, reduce-scatters and reshards: k = 1's collectives."""
        if self.accumulate == "sharded":  # every micro-batch reduce-scatters (torch's defaults): memory stays sharded
            return contextlib.nullcontext()
        self.root.set_requires_gradient_sync(enabled)  # read at backward: reduce-scatter now, or keep adding up
        self.root.set_reshard_after_backward(enabled)
        for unit in self.units:  # the root keeps its own default (no reshard after forward)
            unit.set_reshard_after_forward(enabled, recurse=False)
        return contextlib.nullcontext()

    def model_state(self, module) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module)  # DTensors under the plain names

    def load_model_state(self, module, state: dict) -> None:
        """A sharded state (DTensors, from a DCP checkpoint) loads shard by shard; a whole one (plain tensors: a
        one-file checkpoint of a one-process run, or a notebook's) is split into this process's shards on the way
        in (torch's StateDictOptions(full_state_dict=True): every process holds the whole state while loading)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, state, options=self._options(state))

    @staticmethod
    def _options(state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=_plain(state))

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

        state = optimizer_by_name(state, module, optimizer)  # a one-file checkpoint's is by position
        set_optimizer_state_dict(module, optimizer, state, options=self._options(state))

    def describe(self) -> str:
        mp = " (bf16 gathers, fp32 reduction)" if self.mixed_precision() is not None else ""
        where = f"{self.hosts} hosts x {self.rt.world_size // self.hosts} processes" if self.hsdp else ""
        head = f"hsdp over {where}" if self.hsdp else f"fsdp2 over {self.rt.world_size} processes"
        return head + mp + (f"; {self.said}" if self.said else "")


def hosts(rt) -> int:
    """How many hosts torchrun's processes span: WORLD_SIZE // LOCAL_WORLD_SIZE (torchrun sets both)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size) or rt.world_size)
    if local < 1 or rt.world_size % local:
        raise PlanError(
            f"parallel='hsdp': {rt.world_size} processes do not split into hosts of LOCAL_WORLD_SIZE={local}; launch "
            "the same --nproc-per-node on every host"
        )
    return rt.world_size // local


def accumulation(plan, params: int) -> tuple[str, str]:
    """(mode, the sentence that says why) for accumulation under fsdp2/hsdp, from TrainConfig.fsdp_accumulate.
    gathered: per process, the whole model's gathered weights (the gather dtype: 2 B a weight under bf16, else 4)
    and its unreduced float32 gradients (4 B), through the window, beside its shard of the weights, gradients and
    AdamW state (16 B a weight / processes per shard group); k = 1's collectives. sharded: only the shard (plus
    one unit gathered at a time); k times the all-gathers and reduce-scatters. auto: gathered where it fits half
    the device memory (labkit.parallel.device_memory), else sharded."""
    if plan.accum_steps <= 1:
        return plan.accumulate, ""
    shard = plan.rt.world_size // plan.hosts
    gather = 2 if plan.mixed_precision() is not None else 4
    gathered, sharded = accumulation_bytes(params, shard, gather)
    mode, memory = plan.accumulate, device_memory(plan.rt)
    if mode == "auto":
        mode = "gathered" if memory is None or gathered <= memory / 2 else "sharded"
        why = f"{gathered / 2**20:,.0f} MB {'fit' if mode == 'gathered' else 'do not fit'} half of "
        why += f"{memory / 2**20:,.0f} MB" if memory else "an unknown memory"
    else:
        why = "asked for"
    if mode == "gathered":
        cost = f"{gathered / 2**20:,.0f} MB a process (whole weights and gradients), k = 1's collectives"
    else:
        cost = f"{sharded / 2**20:,.0f} MB a process (shards), {plan.accum_steps}x k = 1's collectives"
    return mode, f"accumulation {mode} ({why}): {cost}"


def accumulation_bytes(params: int, shard: int, gather: int = 4) -> tuple[int, int]:
    """(gathered, sharded): bytes per process through an accumulation window under fsdp2/hsdp, padding and
    activations left out. Both hold the shard of weights, gradients and AdamW state (16 B a weight / `shard`, the
    processes a weight is split over); gathered adds the whole model's gathered weights (`gather` B a weight: 2
    under bf16) and its whole unreduced float32 gradients (4 B)."""
    sharded = params * STATE_BYTES_PER_WEIGHT // shard
    return params * (gather + 4) + sharded, sharded


def device_memory(rt) -> int | None:
    """Bytes one process may use: LABKIT_MEMORY_MB where set (a budget of your own: what "auto" plans for, e.g. to
    try on the CPU what a smaller device would force), else the accelerator's memory, or on the CPU the host's RAM
    shared by its processes."""
    raw = os.environ.get("LABKIT_MEMORY_MB", "").strip()
    if raw:
        try:
            mb = float(raw)
            if not mb > 0:
                raise ValueError
        except ValueError:
            raise PlanError(f"LABKIT_MEMORY_MB={raw!r}: expected a number of megabytes > 0") from None
        return int(mb * 2**20)
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


def auto_plan(params: int, memory: int | None, devices: int, hosts: int = 1) -> str:
    """ "replicate" when a whole copy's weights, gradients and AdamW state fit half of `memory`; else, on several
    hosts, "hsdp" when a host's share (sharded over its processes only) fits; else "fsdp2"."""
    if memory is None or fits(params, memory / 2, devices, "data", STATE_BYTES_PER_WEIGHT):
        return "replicate"
    if hosts > 1 and params * STATE_BYTES_PER_WEIGHT / (devices // hosts) <= memory / 2:
        return "hsdp"
    return "fsdp2"


def check_setting(setting, name: str = "TrainConfig.parallel") -> str:
    """`setting` when it names a plan; else PlanError naming where it came from (`name`: a flag, a variable)."""
    if setting not in PLANS:
        raise PlanError(f"{name}={setting!r}: expected one of {', '.join(PLANS)}")
    return setting


def choose(rt, setting: str = "auto", precision=None, model=None, accumulate="auto", accum_steps=1) -> Single:
    """The plan for TrainConfig.parallel on this runtime. Several torch.distributed processes (rt.uses_ddp and
    world_size > 1): "replicate", "fsdp2", or "auto" by what fits (model: to count its parameters). One process,
    XLA and SPMD: Single ("auto"); asking them for replicate or fsdp2 is refused by name."""
    check_setting(setting)
    torchrun = rt.uses_ddp and rt.world_size > 1
    if not torchrun:
        if setting != "auto":
            where = f"world size {rt.world_size}" if rt.uses_ddp else f"the {rt.kind} runtime (spmd={rt.spmd})"
            raise PlanError(
                f"TrainConfig.parallel={setting!r} needs torchrun with 2 or more processes of torch.distributed "
                f"(cpu/gloo or cuda/nccl); this run has {where}. Use parallel='auto' here, or launch with "
                "`torchrun --nproc-per-node N -m labkit.train ...`"
            )
        return Single(rt)
    if setting == "auto":
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        setting = auto_plan(params, device_memory(rt), rt.world_size, hosts(rt))
    if setting in ("fsdp2", "hsdp"):
        if precision is not None and precision.needs_scaler:
            raise PlanError(
                f"parallel={setting!r} with fp16: the GradScaler of labkit.precision does not handle sharded "
                "gradients; use bf16 (MixedPrecisionPolicy) or fp32 under FSDP2, or parallel='replicate'"
            )
        return FullyShard(rt, precision, accumulate, accum_steps, hsdp=setting == "hsdp")
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
                n = collective_bytes(args, out)
                self.counts[name] = self.counts.get(name, 0) + 1
                self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + n
                where = self.by_group.setdefault((name, _group_name(args, kwargs)), [0, 0])
                where[0], where[1] = where[0] + 1, where[1] + n
            return out

        def get_comm_counts(self) -> dict:
            return dict(self.counts)

    mode = _Count()
    mode.counts, mode.bytes_by_op, mode.by_group = {}, {}, {}
    return mode


def _group_name(args, kwargs) -> str | None:
    """The process group a c10d op ran on (its boxed ProcessGroup argument) or a functional one's group name."""
    import torch.distributed as dist

    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except Exception:  # another boxed object (a ReduceOp)
                continue
    strings = [a for a in args if isinstance(a, str)]
    return strings[-1] if strings else None


def comm_by_dim(mode, mesh) -> dict:
    """{mesh dimension: {op: [count, bytes]}} from a collective_counter: which collectives ran inside a host and
    which crossed hosts (an HSDP mesh's "shard" and "replicate"); ops on no dimension of `mesh` under "other"."""
    dims = {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}
    out: dict = {}
    for (op, group), (count, nbytes) in mode.by_group.items():
        out.setdefault(dims.get(group, "other"), {})[op] = [count, nbytes]
    return out
