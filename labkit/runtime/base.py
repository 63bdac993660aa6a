"""The base backend: `Runtime` is the plain CPU, and every seam's default (labkit.runtime's table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from labkit import precision as _precision
from labkit import seeding
from labkit.runtime import layout as _layout
from labkit.runtime import step as _step


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
    # several processes average gradients with DistributedDataParallel in backward (labkit.parallel: DDP or FSDP2);
    # XLA replicas reduce in optimizer_step instead, and SPMD's compiler inserts the all-reduce
    uses_ddp = True
    # AdamW(fused=True): one kernel for the whole update (labkit.optim.adamw_options); CUDA only, where it pays
    fused_optimizers = False
    # the memory format for models with 2-D convolutions under TrainConfig.memory_format="auto" (labkit.runtime.layout)
    layout = _layout.Layout(
        False,
        "the plain CPU: whether channels_last pays depends on the CPU and the shapes, so labkit does not guess "
        "(TrainConfig.memory_format='probe' measures this CPU)",
    )
    _said_layout = None  # the last decision said (choose_layout says each new one once)
    _said_tune = False

    # (kind, spmd) pairs this class runs; each subclass names its own, and Runtime(kind, ...) builds the class
    # registered for them (labkit.runtime imports every backend module, so all are registered)
    backs: ClassVar[tuple] = (("cpu", False),)
    _registry: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for key in cls.__dict__.get("backs", ()):
            Runtime._registry[key] = cls

    def __new__(cls, *args, **kwargs):
        if cls is Runtime:  # Runtime("tpu", ...) -> the class of that backend
            kind = kwargs.get("kind", args[0] if args else None)
            spmd = bool(kwargs.get("spmd", args[6] if len(args) > 6 else False))
            cls = Runtime._registry.get((kind, spmd)) or Runtime._registry.get((kind, False)) or Runtime
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

    def own_scalars(self, state):
        """A restored state ready to load (labkit.resume). Eager backends copy each tensor as it loads: as it is."""
        return state

    def add_step_closure(self, fn, args=()) -> None:
        """Run fn(*args) once the current step's values exist: eagerly, that is now."""
        fn(*args)

    def reduce_gradients(self, optimizer) -> None:
        """Average gradients over replicas before the step. Under torchrun DDP already did it in backward."""

    def wait(self) -> None:
        """Block until the device finished what was queued (to time a step)."""

    def step_capture(self, setting: str = "auto", backend: str = "inductor", steps: int | None = None):
        """How the Trainer captures a step (labkit.runtime.step): torch.compile for TrainConfig.compile="on", and for
        "auto" when the run's planned `steps` exceed this kind's compile payback (step.PAYBACK_STEPS; one line says
        which and why), else the step as written."""
        log = self.master_print if setting == "auto" else None
        return _step.choose(setting, backend, self.kind, steps, log=log)

    def choose_layout(self, model, setting: str = "auto") -> _layout.Layout:
        """The memory format this run trains `model` in (labkit.runtime.layout), said once with the reason."""
        return self._say_layout(_layout.decide(model, setting, self.layout, probe=_layout.measure))

    def _say_layout(self, layout):
        if layout != self._said_layout:
            self._said_layout = layout
            self.master_print(layout.describe())
        return layout

    def adamw_options(self) -> dict:
        """torch.optim.AdamW's keywords for this backend: capturable where the step is traced into a graph (XLA),
        fused where one kernel for the whole update pays (CUDA); on the plain CPU torch's defaults."""
        return {"capturable": self.capturable_optimizers, **({"fused": True} if self.fused_optimizers else {})}

    def autotune(self, fixed_shapes: bool) -> None:
        """Let the backend tune its kernels for shapes that never change (cuDNN's autotuner): nothing here."""

    # -- replicas ------------------------------------------------------------------------------
    def master_print(self, *args, **kwargs) -> None:
        if self.is_master:
            print(*args, **kwargs, flush=True)

    def rendezvous(self, tag: str) -> None:
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def broadcast_object(self, obj, tag: str):
        """Process 0's `obj` (picklable) on every process: one decision, taken once (a run folder's name)."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            box = [obj]
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]
        return obj

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
        """Device batches from `host` (labkit.loader.DeviceLoader's host-side iterator): here, as they come, images
        in the loader's memory format."""
        if not loader.layout.channels_last:
            return iter(host)
        return (loader.layout.batch(b) for b in host)

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


Runtime._registry[("cpu", False)] = Runtime
