"""How a model is laid out over torchrun's processes: one object per plan, chosen once per run.

    plan = labkit.parallel.choose(rt, "auto", precision)   # TrainConfig.parallel: auto | replicate | fsdp2 | hsdp
    model = plan.wrap(model, optimizer)                     # DDP, fully_shard per block then the root, or as is
    with plan.gradient_sync(last_micro_batch): loss.backward()   # accumulation: only the last one reduces
    state = plan.model_state(model); plan.load_model_state(model, state)   # plain keys, whatever the plan
    with collective_counter() as c: ...; comm_by_dim(c, plan.mesh)         # what a step issued, per mesh dimension

The Trainer asks for a plan the way it asks its runtime for a step capture (rt.step_capture): it calls the plan's
methods and never asks which one runs. Four plans:

- `Single`: one process, or XLA's replicas (they reduce in optimizer_step) and SPMD (the compiler inserts the
  collectives): the model as it is.
- `Replicate` ("replicate"): DistributedDataParallel, each process a whole copy; gradients all-reduced in backward.
- `FullyShard` ("fsdp2"): torch.distributed.fsdp.fully_shard (FSDP2) on each unit, then on the root. The units
  (labkit.parallel.units) are the GPT's transformer blocks and a ResNet's residual blocks (16 in ResNet-50); the root
  keeps the rest (embeddings, a ResNet's stem and classifier). Every parameter becomes a DTensor Shard(0) over the
  processes. Forward all-gathers a unit, uses it and frees it; the last unit stays gathered, because its backward
  comes next. Backward gathers every other unit again and reduce-scatters each unit's gradients. So a step of L
  blocks issues 2L all-gathers (the root once, L blocks in forward, L - 1 in backward) and L + 1 reduce-scatters:
  4 and 3 for the 2-block GPT that tests/test_fsdp_trainer.py counts, plus one all-reduce of the gradient norm's
  partial sums when clipping.
- `FullyShard` ("hsdp"): the same on a 2-D mesh (hosts, processes per host). Weights are sharded within a host, so
  the all-gathers and reduce-scatters never leave it, and replicated across hosts: one all-reduce of each process's
  gradient shard crosses them per step.

Under bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the gathered weights are bf16, the kept
shards, the gradient reduction and AdamW's state fp32. BatchNorm keeps float32 weights, so its weights are gathered
apart: a residual block's BatchNorms form one unit (fully_shard takes a list of modules), and the ones outside
every block one more. ResNet-50 has 17 such units for its 53 BatchNorms. They are not freed after forward (0.2 MB
in all), so each costs one small all-gather and one reduce-scatter a step: 34 collectives, where a unit per
BatchNorm freed after forward cost 159.

"auto" under torchrun picks by what fits: weights + gradients + AdamW's two moments (labkit.spmd.comm.fits: 16 bytes
a float32 weight) of a whole copy on each device, against half of one device's memory (the other half for
activations, the batch and the allocator's slack). Replicate where that fits; over several hosts, hsdp where a
host's share fits; fsdp2 otherwise.

Gradient accumulation (TrainConfig.accum_steps = k): `gradient_sync(False)` for the first k-1 micro-batches keeps
their gradients on each process (DDP's no_sync()). Under FSDP2, TrainConfig.fsdp_accumulate (`--fsdp-accumulate`)
picks how:
- gathered: set_requires_gradient_sync(False), and the weights stay gathered (set_reshard_after_forward(False) on the
  units, set_reshard_after_backward(False) on all of them, the BatchNorm units included). The first forward gathers
  each unit once, and nothing is gathered again until the last micro-batch, whose backward gathers the units as
  k = 1's does. Counted: the collectives of k = 1 per optimizer step (16 all-gathers at k = 4 before, for 2 blocks).
  The price is memory, for the whole window: every process holds the whole model's gathered weights (in the gather
  dtype) and its whole unreduced gradients, as DDP does; only AdamW's state stays sharded.
- sharded: every micro-batch gathers and reduce-scatters as k = 1 does (k times the collectives), and memory stays
  sharded. Under hsdp the all-reduce across hosts waits for the last micro-batch (set_requires_all_reduce(False)
  before it): the slow link is crossed once per optimizer step, as at k = 1.
- auto: gathered where it fits half the device memory, else sharded (labkit.parallel.accumulation says which, why).

State: FSDP2's parameters are DTensors; `model_state` / `optimizer_state` are torch.distributed.checkpoint's
get_model_state_dict / get_optimizer_state_dict (keys as the plain model names them: "blocks.0.attn.qkv.weight",
the optimizer's by parameter name; how the units are grouped changes no name). labkit.checkpoint's sharded format then
has every process write its own shards with DCP (process 0 adds the metadata and, once every process has stored its
files, the commit marker), and a run on another number of processes reads them back (DCP reshards).
"""

from labkit.parallel.choice import auto_plan, check_setting, choose
from labkit.parallel.count import collective_counter, comm_by_dim
from labkit.parallel.fsdp import FullyShard, accumulation, accumulation_bytes, batchnorm_groups, hosts, units
from labkit.parallel.memory import STATE_BYTES_PER_WEIGHT, device_memory
from labkit.parallel.plans import PlanError, Processes, Replicate, Single, broadcast_buffers
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
