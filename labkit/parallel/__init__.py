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

from labkit.parallel.choice import auto_plan, check_setting, choose
from labkit.parallel.count import collective_counter, comm_by_dim
from labkit.parallel.fsdp import FullyShard, accumulation, accumulation_bytes, batchnorm_groups, hosts, units
from labkit.parallel.plans import (
    STATE_BYTES_PER_WEIGHT,
    PlanError,
    Processes,
    Replicate,
    Single,
    broadcast_buffers,
    device_memory,
)
from labkit.parallel.state import optimizer_by_id, optimizer_by_name

__all__ = [
    "STATE_BYTES_PER_WEIGHT",
    "FullyShard",
    "PlanError",
    "Processes",
    "Replicate",
    "Single",
    "accumulation",
    "accumulation_bytes",
    "auto_plan",
    "batchnorm_groups",
    "broadcast_buffers",
    "check_setting",
    "choose",
    "collective_counter",
    "comm_by_dim",
    "device_memory",
    "hosts",
    "optimizer_by_id",
    "optimizer_by_name",
    "units",
]
