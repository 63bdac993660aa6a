"""torch_xla's backends: XLA:CPU, the TPU chip, and SPMD on either (labkit.runtime's table)."""

from __future__ import annotations

import os

import torch

from labkit import precision as _precision
from labkit.runtime import step as _step
from labkit.runtime.base import Runtime
from labkit.runtime.layout import SETTINGS, Layout, has_conv2d, map_tensors


class XlaRuntime(Runtime):
    """torch_xla (PJRT) on XLA:CPU: lazy tensors compiled for this machine's CPU; TpuRuntime is the chip."""

    backs = (("xla-cpu", False),)

    is_xla = True
    capturable_optimizers = True
    reads_metrics = True
    uses_ddp = False
    # who copies batches to the device for a DeviceLoader(feed="auto"), and why (said once per runtime). On XLA:CPU
    # torch_xla's loader threads (pl.ParallelLoader), though they share the 2 cores with XLA's compute threads: a
    # copy to the device waits for the step running there, and from the loop's thread it would stop the tracing of
    # the next step meanwhile (bench/bench_peers.py --ablations, 2026-11-28: MLP step 0.59x with the threads,
    # rounds 0.30-0.85; ResNet-18 1.02x, within its spread). A TPU keeps them too, for its own reason (_OnTpu).
    feed = "thread"
    feed_why = (
        "a copy waits for the step running on XLA:CPU's cores; from the loop's thread it would stall the tracing of "
        "the next step (an MLP step took 1.7x longer so, in the repository's timing of training loops, "
        "bench/bench_peers.py)"
    )
    _said_feed = False

    def sync(self) -> None:
        """Cut the lazy graph here, compile it if it is new, and launch it."""
        import torch_xla

        torch_xla.sync()

    def own_scalars(self, state):
        """The restored state with its one-element tensors (AdamW's `step` per parameter, BatchNorm's
        num_batches_tracked) already on the device, each in a buffer of its own, in one transfer.

        torch_xla copies a host scalar into a buffer it shares with every other copy of the same value, and puts 0
        and 1 into the graph as constants. Loaded one by one, the 161 `step` tensors of notebook 01's ResNet-50
        became one input of the first step after a resume, where training had left 161: a graph of its own,
        compiled again before training went on (11 s on XLA:CPU; on a chip, a full step's compile).
        xm.send_cpu_data_to_device gives each tensor its own buffer, as a step's outputs have."""
        import torch_xla.core.xla_model as xm

        found: list[torch.Tensor] = []

        def collect(t):
            if t.dim() == 0 and t.device.type == "cpu":
                found.append(t)
            return t

        map_tensors(state, collect)
        if not found:
            return state
        moved = {id(t): d for t, d in zip(found, xm.send_cpu_data_to_device(found, self.device))}
        return map_tensors(state, lambda t: moved.get(id(t), t))

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def choose_layout(self, model, setting: str = "auto") -> Layout:
        """Contiguous, whatever is asked: XLA's compiler picks each tensor's layout for the chip itself, so an eager
        tensor's strides would only add a transpose to the graph."""
        if setting not in SETTINGS:
            raise ValueError(f"TrainConfig.memory_format={setting!r}: expected one of {', '.join(SETTINGS)}")
        if not has_conv2d(model):
            return self._say_layout(Layout(False, "the model has no 2-D convolution"))
        asked = f" (memory_format={setting!r} ignored)" if setting not in ("auto", "contiguous") else ""
        return self._say_layout(Layout(False, f"XLA chooses its own layouts for the chip{asked}"))

    def step_capture(self, setting: str = "auto", backend: str = "inductor", steps: int | None = None):
        """The lazy trace is this backend's capture: the step is recorded and compiled at sync(), so it stays as it
        is. "on" is refused rather than ignored: torch.compile on lazy tensors is another engine (openxla)."""
        if setting == "on":
            raise ValueError(
                "TrainConfig.compile='on' on XLA: torch_xla already compiles the whole step at rt.sync() (the lazy "
                "trace); labkit does not torch.compile on top of it. Use compile='auto' or 'off' here"
            )
        return _step.EagerStep()

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

    def broadcast_object(self, obj, tag: str):
        """A TPU pod's hosts: every host's payload goes to all (xm.rendezvous), and process 0's is kept. `obj` is a
        JSON value here (bytes from another host are decoded as data, never unpickled)."""
        if self.world_size <= 1:
            return obj
        import json

        import torch_xla.core.xla_model as xm

        return json.loads(xm.rendezvous(tag, json.dumps(obj).encode())[0].decode())

    def _all_reduce_sum(self, tensor):
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def iterate(self, loader, host):
        sharding = self.input_sharding(loader)
        if self.choose_feed(loader) == "thread":
            return loader.xla_batches(host, sharding)  # uploaded ahead by pl.ParallelLoader's threads
        return loader.xla_batches_here(host, sharding)  # each batch copied by the loop's thread, as it comes

    def input_sharding(self, loader):
        """How a batch is laid over the devices (None: whole, on this process's one device)."""
        return loader.input_sharding

    def choose_feed(self, loader) -> str:
        """The feed, "thread" or "main": the loader's own feed=, else this runtime's (said once, with why)."""
        if loader.feed != "auto":
            return loader.feed
        if not self._said_feed:
            self._said_feed = True
            how = "by a background thread, a few ahead" if self.feed == "thread" else "in the training loop's thread"
            self.master_print(f"[labkit] batches are copied to {self.device} {how}: {self.feed_why}")
        return self.feed

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
        return _precision.for_xla_cpu(mode, want)  # no bf16 matrix units: fp32

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
        return "cpu"  # XLA:CPU runs on this machine's CPU


class _OnTpu:
    """What the TPU chip changes on top of torch_xla: bf16 by default, batches fed ahead, and the chip's name."""

    feed = "thread"
    feed_why = "the chip computes apart from the host, so copying the next batches a few ahead overlaps the step"

    def precision_for(self, mode: str, want) -> _precision.Precision:
        return _precision.for_tpu(mode, want)

    def chip_name(self) -> str | None:
        try:  # the runtime's device kind, e.g. "TPU v4" (host-side, no device work)
            import torch_xla.core.xla_model as xm

            name = xm.xla_device_kind(self.device)
            if name and name.strip().upper() != "TPU":
                return name
        except Exception:  # noqa: BLE001 - older torch_xla: fall back to the TPU VM's environment
            pass
        return os.environ.get("TPU_ACCELERATOR_TYPE") or "TPU (unknown version)"


class TpuRuntime(_OnTpu, XlaRuntime):
    """torch_xla on TPU chips: one process per chip when there are replicas (xmp.spawn / torchrun)."""

    backs = (("tpu", False),)


class SpmdRuntime(XlaRuntime):
    """torch_xla SPMD: one process per host drives all its chips; the compiler (GSPMD) partitions the step and
    inserts the collectives, so nothing is reduced by hand and world_size counts hosts. On XLA:CPU here."""

    backs = (("xla-cpu", True),)

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

    def input_sharding(self, loader):
        # each batch is split over the devices; by default along "data" on a 1-D mesh of every device
        return loader.input_sharding or loader.data_parallel_sharding()


class TpuSpmdRuntime(_OnTpu, SpmdRuntime):
    """SPMD over a host's TPU chips."""

    backs = (("tpu", True),)
