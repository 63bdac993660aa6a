"""The plans every process count shares: one process as it is (Single), and what any plan over several torchrun
processes needs (Processes: buffers made equal, evaluation in lockstep, per-process state), with DDP (Replicate)
on top. The memory a process may plan for is labkit.parallel.memory's.

    plan = Replicate(rt); model = plan.wrap(model, optimizer)
    for batch, real in plan.lockstep(eval_batches, spare=last_train_batch): ...
"""

from __future__ import annotations

import contextlib

import torch

from labkit import meta_init
from labkit.parallel.state import optimizer_by_id
from labkit.torchrun import side_group


class PlanError(ValueError):
    """A parallel setting this run cannot use (a flag, LABKIT_PARALLEL or TrainConfig.parallel): `python -m
    labkit.train` prints it as one line naming the setting, exit 2, no traceback."""


class Single:
    """One process (or XLA's own replication): nothing to wrap, nothing to sync."""

    name = "single"
    # the weights may take the run's memory format (labkit.runtime.layout): FSDP2 refuses non-contiguous parameters
    weights_in_layout = True

    def __init__(self, rt=None):
        self.rt = rt

    def wrap(self, model, optimizer):
        """The model laid out for this plan; one built on the meta device (labkit.meta_init) given memory first."""
        if meta_init.is_meta(model):  # the optimizer built on it keeps its Parameters (materialize swaps in place)
            meta_init.materialize(model, self.rt.device)
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
        for ever. Before each batch the processes agree whether any still has one, and whether any has nothing to
        run (no batch and no spare: then every process raises, naming it): one all-reduce (MAX) of two 4-byte flags
        over the CPU (gloo), the cost of the step vote (labkit.interrupts.StepVote), per evaluation batch."""
        import torch.distributed as dist

        group = _cpu_group(self)
        it, last = iter(batches), spare
        while True:
            batch = next(it, None)
            stuck = batch is None and last is None  # nothing to run a forward with, real or padding
            flag = torch.tensor([batch is not None, stuck], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if not flag[0].item():
                return
            if flag[1].item():  # on every process: one of them cannot keep in step, so none starts the forward
                every = [None] * self.rt.world_size
                dist.all_gather_object(every, stuck, group=group)
                who = ", ".join(str(r) for r, s in enumerate(every) if s)
                raise RuntimeError(
                    f"evaluation: process {who} of {self.rt.world_size} has no evaluation batch left while others do, "
                    "and no training batch to run the padding forwards with (an evaluation before the first training "
                    "step): give every process at least one evaluation batch (fewer processes, or more evaluation "
                    "shards), or evaluate after training a step"
                )
            if batch is not None:
                last = batch
                yield batch, True
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
    one made once per plan with LABKIT_DIST_TIMEOUT_S (labkit.torchrun.side_group; dist.new_group is itself
    collective: every process makes it at the same call)."""
    import torch.distributed as dist

    if plan._cpu is None:
        plan._cpu = dist.group.WORLD if dist.get_backend() == "gloo" else side_group()
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
