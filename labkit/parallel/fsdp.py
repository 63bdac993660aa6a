"""FSDP2 as labkit lays it out: fully_shard per unit then the root, on a 1-D mesh (fsdp2) or a 2-D one (hsdp),
BatchNorm kept in float32 under bf16, accumulation gathered or sharded by arithmetic, states by parameter name.

    plan = FullyShard(rt, precision, accumulate="auto", accum_steps=4, hsdp=False)
    model = plan.wrap(model, optimizer)           # a meta-built model (labkit.meta_init) is filled once sharded
    with plan.gradient_sync(last_micro_batch): loss.backward()
"""

from __future__ import annotations

import contextlib
import os

import torch

from labkit import meta_init
from labkit.parallel.memory import STATE_BYTES_PER_WEIGHT, device_memory
from labkit.parallel.plans import PlanError, Processes
from labkit.parallel.state import _plain, optimizer_by_name


def _batchnorms(model) -> list:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def batchnorm_groups(model, blocks=None) -> list[list]:
    """The BatchNorms FSDP2 shards together under bf16, one group per unit (labkit.parallel.units): a residual
    block's BatchNorms (3 in a ResNet-50 Bottleneck, 4 where it has a downsample) form one group, and those outside
    every unit (the stem's) one more. ResNet-50: 17 groups for its 53 BatchNorms. fully_shard takes a list of
    modules (torch 2.9: one FSDPParamGroup, gathered at the first one's forward): one collective per group."""
    blocks = units(model) if blocks is None else blocks
    groups, seen = [], set()
    for unit in blocks:
        mine = [m for m in _batchnorms(unit) if id(m) not in seen]
        seen.update(id(m) for m in mine)
        if mine:
            groups.append(mine)
    rest = [m for m in _batchnorms(model) if id(m) not in seen]
    return groups + ([rest] if rest else [])


def units(model) -> list:
    """The submodules FSDP2 shards as units of their own, before the root, in forward order: model.fsdp_units() if
    it has one, the GPT's transformer blocks, a (torchvision) ResNet's residual blocks (16 in ResNet-50: a unit is
    what is gathered at once, and a whole stage, ResNet-50's layer3 with 7.1 M weights, would be gathered whole);
    [] otherwise (the root alone: one unit). The root keeps what is left: the GPT's embeddings and final norm (its
    head is the embedding matrix, tied), a ResNet's stem and classifier."""
    if callable(getattr(model, "fsdp_units", None)):
        return list(model.fsdp_units())
    if isinstance(getattr(model, "blocks", None), torch.nn.ModuleList):
        return list(model.blocks)
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    if not all(isinstance(s, torch.nn.Module) for s in stages):
        return []
    return [block for s in stages for block in (s if isinstance(s, torch.nn.Sequential) else [s])]


class FullyShard(Processes):
    """FSDP2: fully_shard on each unit (labkit.parallel.units), then the root, over all torchrun processes."""

    name = "fsdp2"
    # fully_shard refuses a channels_last parameter (torch 2.9: "FSDP does not support non-contiguous parameters"):
    # the weights stay contiguous, and a channels_last batch makes cuDNN run the convolution in channels_last anyway
    weights_in_layout = False

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
        single bf16 policy over a ResNet gives at its first BatchNorm. The cost: the BatchNorms of one block are a
        unit of their own (labkit.parallel.fsdp.batchnorm_groups: 17 in ResNet-50, for 53 BatchNorms), each one
        all-gather in forward and one reduce-scatter in backward a step: latency, a few KB each, not bandwidth.
        They are not freed after forward (reshard_after_forward=False: ResNet-50's BatchNorm weights are 0.2 MB),
        so backward gathers none of them again: 34 collectives a step where a unit per BatchNorm, freed after
        forward, took 159 (53 x 3)."""
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
        if meta_init.is_meta(model):  # refused now, while its tensors are still the ones build() recorded
            meta_init.check(model)
        self.mesh = self.make_mesh()
        kw = {"mesh": self.mesh}
        if self.mixed_precision() is not None:
            kw["mp_policy"] = self.mixed_precision()
        before = dict(model.named_parameters())
        self.accumulate, self.said = accumulation(self, sum(p.numel() for p in before.values()))
        self.units = units(model)
        if "mp_policy" in kw:  # BatchNorm keeps float32 weights: a unit per block, gathered in float32
            for group in batchnorm_groups(model, self.units):
                fully_shard(group, mesh=self.mesh, mp_policy=self.batchnorm_precision(), reshard_after_forward=False)
        for i, unit in enumerate(self.units):  # the last unit stays gathered after forward: backward needs it first
            fully_shard(unit, **kw, reshard_after_forward=self._reshard(i))
        self.root = fully_shard(model, **kw)
        _repoint(optimizer, before, model)  # an optimizer built on the plain model now steps the shards
        if meta_init.is_meta(model):  # built on the meta device: only now, sharded, does each process get memory
            meta_init.materialize(model, self.rt.device)  # in place: the optimizer keeps the shards it was given
        return self.root

    def gradient_sync(self, enabled: bool):
        """enabled=False (a micro-batch before the last): no reduce-scatter (the gradients add up unsharded), and the
        weights, once gathered, stay gathered: no reshard after the units' forward nor after backward (the
        BatchNorm units included: set recursively), so the next micro-batches gather nothing. enabled=True (the
        last, or k = 1): torch's defaults again, so its forward frees each unit, its backward gathers it again,
        reduce-scatters and reshards: k = 1's collectives.

        Sharded accumulation reduce-scatters every micro-batch (memory stays sharded); under hsdp the all-reduce
        across hosts of those gradient shards waits for the last one (set_requires_all_reduce(False) before it: the
        shards add up on each process), so the slow link is crossed once per optimizer step, as at k = 1."""
        if self.accumulate == "sharded":
            if self.hsdp:
                self.root.set_requires_all_reduce(enabled)  # recursive: every unit's gradient shards
            return contextlib.nullcontext()
        self.root.set_requires_gradient_sync(enabled)  # read at backward: reduce-scatter now, or keep adding up
        self.root.set_reshard_after_backward(enabled)
        for i, unit in enumerate(self.units):  # the root keeps its own default (no reshard after forward)
            unit.set_reshard_after_forward(enabled and self._reshard(i), recurse=False)
        return contextlib.nullcontext()

    def _reshard(self, i: int) -> bool:
        """Whether unit i frees its gathered weights after its forward: all but the last (torchtitan's policy). The
        last unit's backward comes right after its forward, so freeing it would only gather it again: one all-gather
        of the last unit saved per step, for the memory of one unit held through that step's backward."""
        return i < len(self.units) - 1

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


def _repoint(optimizer, before: dict, model) -> None:
    """The optimizer's parameters swapped, by name, for the model's current ones: fully_shard replaces each
    Parameter an optimizer built earlier holds with a sharded one."""
    after = dict(model.named_parameters())
    swap = {id(before[n]): after[n] for n in before if n in after}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
