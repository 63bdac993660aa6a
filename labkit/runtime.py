"""The backends: one small class per way of running, each owning what differs between TPU, GPU and CPU.

    rt = labkit.setup()          # an XlaRuntime, SpmdRuntime, CudaRuntime or Runtime (plain CPU)
    rt.sync(); rt.to_device(batch); rt.reduce_gradients(opt); rt.seed_device(0); rt.precision_for("auto")

`Runtime` itself is the plain CPU: eager ops, gloo under torchrun. The others override the seams that differ:

| seam                       | Runtime (CPU)     | CudaRuntime               | XlaRuntime (TPU, XLA:CPU)        | SpmdRuntime              |
|----------------------------|-------------------|---------------------------|----------------------------------|--------------------------|
| sync()                     | nothing           | nothing (async kernels)   | torch_xla.sync(): compile + run  | same                     |
| add_step_closure(fn)       | fn() now          | fn() now                  | after the step's graph ran       | same                     |
| reduce_gradients(opt)      | nothing (DDP)     | nothing (DDP)             | xm.reduce_gradients (> 1 replica)| nothing: GSPMD inserts it|
| all_reduce / rendezvous    | torch.distributed | torch.distributed         | xm.all_reduce / xm.rendezvous    | identity (one process)   |
| iterate(loader, host)      | the host batches  | pinned, copied on a stream| pl.ParallelLoader                | + the batch's sharding   |
| seed / RNG state           | torch             | + every CUDA generator    | + the XLA generator              | same                     |
| precision_for(mode)        | fp32              | bf16 (>= 8.0) or fp16     | bf16 on TPU, fp32 on XLA:CPU     | same                     |
| profiler                   | torch.profiler    | + CUDA activities         | torch_xla's trace                | same                     |
| data_split()               | (rank, world)     | (rank, world)             | (replica, replicas)              | (host, hosts)            |
| memory() / chip_name()     | None / "cpu"      | allocator / device name   | xm.get_memory_info / device kind | same                     |
| reads_metrics / uses_ddp   | no / yes          | no / yes                  | yes (torch_xla's) / no           | same                     |
| devices_per_process()      | 1                 | 1                         | 1                                | every addressable device |

`Runtime("cuda", device, ...)` builds the class for that kind (labkit.device and labkit.torchrun do), so the kind
string is data (shown, saved in checkpoints), never a branch: the rest of labkit calls these methods.
docs/backends.md lists each seam on every backend, TorchTPU's included (not run here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from labkit import precision as _precision
from labkit import seeding


class BackendError(RuntimeError):
    """A backend was asked for that this machine or process cannot give."""


@dataclass
class Runtime:
    """Where tensors live and how replicas talk. Build it with `labkit.setup()`. This class is the plain CPU."""

    kind: str
    device: torch.device
    world_size: int = 1
    ordinal: int = 0
    local_ordinal: int = 0
    local_device_count: int = 1
    spmd: bool = False
    info: dict = field(default_factory=dict)
    compile_cache: str | None = None  # the persistent compile cache folder in use (None: off; see info)

    is_xla = False  # lazy tensors: ops are recorded and run at sync()
    # the step is traced into a graph: optimizers keep their step counts on the device (AdamW(capturable=True)),
    # or a bias correction that rounds to 1.0 one day changes the graph (a recompile)
    capturable_optimizers = False
    # torch_xla's counters (compiles, executions, device->host transfers) describe this backend's work: the
    # dashboard's health panel, labkit.explain and the lessons' measurements read them only where this is True
    reads_metrics = False
    # several processes average gradients with DistributedDataParallel in backward (labkit.torchrun.wrap_ddp);
    # XLA replicas reduce in optimizer_step instead, and SPMD's compiler inserts the all-reduce
    uses_ddp = True

    def __new__(cls, *args, **kwargs):
        if cls is Runtime:  # Runtime("tpu", ...) -> the class of that backend
            kind = kwargs.get("kind", args[0] if args else None)
            spmd = kwargs.get("spmd", args[6] if len(args) > 6 else False)
            cls = SpmdRuntime if spmd and kind in _XLA_KINDS else _CLASSES.get(kind, Runtime)
        return object.__new__(cls)

    @property
    def is_master(self) -> bool:
        return self.ordinal == 0

    # -- the step ------------------------------------------------------------------------------
    def sync(self) -> None:
        """End of a step. Eager backends already ran every op: nothing to do."""

    def to_device(self, obj, non_blocking: bool = False):
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=non_blocking)
        if isinstance(obj, dict):
            return {k: self.to_device(v, non_blocking) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.to_device(v, non_blocking) for v in obj]
            return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
        return obj

    def add_step_closure(self, fn, args=()) -> None:
        """Run fn(*args) once the current step's values exist: eagerly, that is now."""
        fn(*args)

    def reduce_gradients(self, optimizer) -> None:
        """Average gradients over replicas before the step. Under torchrun DDP already did it in backward."""

    def wait(self) -> None:
        """Block until the device finished what was queued (to time a step)."""

    # -- replicas ------------------------------------------------------------------------------
    def master_print(self, *args, **kwargs) -> None:
        if self.is_master:
            print(*args, **kwargs, flush=True)

    def rendezvous(self, tag: str) -> None:
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum or mean over replicas (identity with one replica). Returns a new tensor."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        if self.world_size <= 1:
            return tensor
        out = self._all_reduce_sum(tensor)
        return out / self.world_size if op == "mean" else out

    def _all_reduce_sum(self, tensor):
        out = tensor.clone()
        torch.distributed.all_reduce(out)
        return out

    def data_split(self) -> tuple[int, int]:
        """(rank, world) to split the data by: each process reads its own share of the shards."""
        return self.ordinal, max(1, self.world_size)

    def ddp_device_ids(self):
        """device_ids for DistributedDataParallel under torchrun, or None where DDP does not apply."""
        return None

    def devices_per_process(self) -> int:
        """Devices one process feeds with each batch: one, except under SPMD (all the host's)."""
        return 1

    # -- what the dashboard asks (host-side reads: none waits for the device) -----------------------
    def memory(self) -> dict | None:
        """{'used': bytes, 'limit': bytes or None, 'peak': bytes or None}, or None where unknown (CPU)."""
        return None

    def chip_name(self) -> str | None:
        """The chip's own name ('TPU v5 lite', 'v5litepod-8', 'NVIDIA H100 80GB HBM3', 'cpu'): flops looks up
        its peak by it."""
        return "cpu"

    # -- the input pipeline ---------------------------------------------------------------------
    def iterate(self, loader, host):
        """Device batches from `host` (labkit.loader.DeviceLoader's host-side iterator): here, as they come."""
        return iter(host)

    # -- RNG, precision, profiler -----------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        seeding.manual_seed(seed, self)

    def seed_device(self, seed: int) -> None:
        """Seed the device's own generator (the CPU's is torch's, already seeded)."""

    def device_rng_state(self) -> dict:
        """The device generator's state, weights_only-safe ({} when torch's CPU generator is the device's)."""
        return {}

    def set_device_rng_state(self, state: dict) -> None:
        """Put back what device_rng_state captured."""

    def precision_for(self, mode: str, want) -> _precision.Precision:
        return _precision.for_cpu(mode, want)

    def profiler_activities(self) -> list:
        import torch.profiler as tp

        return [tp.ProfilerActivity.CPU]

    def device_names(self) -> list[str]:
        """The devices this process can use, as the doctor lists them."""
        return ["cpu"]

    def __repr__(self) -> str:
        extra = ", spmd" if self.spmd else ""
        extra += f", compile_cache={self.compile_cache!r}" if self.compile_cache else ""
        return (
            f"Runtime(kind={self.kind!r}, device={str(self.device)!r}, world_size={self.world_size}, "
            f"ordinal={self.ordinal}, local_devices={self.local_device_count}{extra})"
        )


class CudaRuntime(Runtime):
    """torch's own CUDA: eager, asynchronous kernels; under torchrun one process per GPU over nccl."""

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)

    def ddp_device_ids(self):
        return [self.device.index]

    def iterate(self, loader, host):
        return loader.cuda_batches(host)  # pinned memory, copied on a side stream (labkit.loader)

    def seed_device(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def device_rng_state(self) -> dict:
        return {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}

    def set_device_rng_state(self, state: dict) -> None:
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])

    def precision_for(self, mode: str, want) -> _precision.Precision:
        return _precision.for_cuda(mode, want, self.device)

    def profiler_activities(self) -> list:
        import torch.profiler as tp

        return [tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]

    def device_names(self) -> list[str]:
        return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]

    def memory(self) -> dict | None:
        """torch's allocator counters: host-side, no synchronisation."""
        idx = self.device.index or 0
        return {
            "used": torch.cuda.memory_allocated(idx),
            "peak": torch.cuda.max_memory_allocated(idx),
            "limit": torch.cuda.get_device_properties(idx).total_memory,
        }

    def chip_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device)


class XlaRuntime(Runtime):
    """torch_xla (PJRT): lazy tensors on a TPU or on XLA:CPU; one process per chip when there are replicas."""

    is_xla = True
    capturable_optimizers = True
    reads_metrics = True
    uses_ddp = False

    def sync(self) -> None:
        """Cut the lazy graph here, compile it if it is new, and launch it."""
        import torch_xla

        torch_xla.sync()

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def add_step_closure(self, fn, args=()) -> None:
        """Run fn(*args) after the current step's graph has executed. Reading a tensor there costs one
        device->host transfer but no extra graph execution: the values are already computed."""
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args=args)

    def reduce_gradients(self, optimizer) -> None:
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)

    def rendezvous(self, tag: str) -> None:
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)

    def _all_reduce_sum(self, tensor):
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def iterate(self, loader, host):
        return loader.xla_batches(host, loader.input_sharding)  # uploaded ahead by pl.ParallelLoader

    def seed_device(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, device=self.device)

    def device_rng_state(self) -> dict:
        import torch_xla.core.xla_model as xm

        return {"xla": int(xm.get_rng_state())}

    def set_device_rng_state(self, state: dict) -> None:
        if "xla" in state:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(state["xla"]))

    def precision_for(self, mode: str, want) -> _precision.Precision:
        if self.kind == "tpu":  # the chip, not the backend: XLA:CPU has no bf16 matrix units
            return _precision.for_tpu(mode, want)
        return _precision.for_xla_cpu(mode, want)

    def profiler_activities(self) -> list:
        return []  # torch_xla's own trace (labkit.profiling.capture), not torch.profiler

    def device_names(self) -> list[str]:
        import torch_xla.core.xla_model as xm

        return [str(d) for d in xm.get_xla_supported_devices()] or [str(self.device)]

    def memory(self) -> dict | None:
        """PJRT's allocator statistics, kept on the host (TPU); XLA:CPU has none."""
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(self.device)
        except (RuntimeError, AttributeError, KeyError):
            return None  # XLA:CPU: "GetAllocatorStats is not supported"
        used = info.get("bytes_used", info.get("kb_total", 0) - info.get("kb_free", 0))
        return {"used": used, "limit": info.get("bytes_limit"), "peak": info.get("peak_bytes_used")}

    def chip_name(self) -> str | None:
        if self.kind != "tpu":  # the chip, not the backend: XLA:CPU runs on this machine's CPU
            return "cpu"
        try:  # the runtime's device kind, e.g. "TPU v4" (host-side, no device work)
            import torch_xla.core.xla_model as xm

            name = xm.xla_device_kind(self.device)
            if name and name.strip().upper() != "TPU":
                return name
        except Exception:  # noqa: BLE001 - older torch_xla: fall back to the TPU VM's environment
            pass
        return os.environ.get("TPU_ACCELERATOR_TYPE") or "TPU (unknown version)"


class SpmdRuntime(XlaRuntime):
    """torch_xla SPMD: one process per host drives all its chips; the compiler (GSPMD) partitions the step and
    inserts the collectives, so nothing is reduced by hand and world_size counts hosts."""

    def reduce_gradients(self, optimizer) -> None:
        """Nothing: the partitioned graph already all-reduces the gradients."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Identity: a tensor under SPMD is one global value, whatever devices hold its pieces."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        return tensor

    def devices_per_process(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.addressable_runtime_device_count())  # the host's chips (CPU_NUM_DEVICES on XLA:CPU)

    def iterate(self, loader, host):
        # each batch is split over the devices; by default along "data" on a 1-D mesh of every device
        return loader.xla_batches(host, loader.input_sharding or loader.data_parallel_sharding())


_XLA_KINDS = ("tpu", "xla-cpu")
_CLASSES = {"tpu": XlaRuntime, "xla-cpu": XlaRuntime, "cuda": CudaRuntime, "cpu": Runtime}
