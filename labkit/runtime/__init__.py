"""The backends: one small class per way of running, each owning what differs between TPU, GPU and CPU.

    rt = labkit.setup()          # a TpuRuntime, XlaRuntime (XLA:CPU), SpmdRuntime, CudaRuntime or Runtime (CPU)
    rt.sync(); rt.to_device(batch); rt.reduce_gradients(opt); rt.seed_device(0); rt.precision_for("auto")

`Runtime` itself is the plain CPU: eager ops, gloo under torchrun. The others override the seams that differ:

| seam                       | Runtime (CPU)     | CudaRuntime               | XlaRuntime (TPU, XLA:CPU)        | SpmdRuntime              |
|----------------------------|-------------------|---------------------------|----------------------------------|--------------------------|
| sync()                     | nothing           | nothing (async kernels)   | torch_xla.sync(): compile + run  | same                     |
| add_step_closure(fn)       | fn() now          | fn() now                  | after the step's graph ran       | same                     |
| reduce_gradients(opt)      | nothing (DDP)     | nothing (DDP)             | xm.reduce_gradients (> 1 replica)| nothing: GSPMD inserts it|
| all_reduce / rendezvous    | torch.distributed | torch.distributed         | xm.all_reduce / xm.rendezvous    | identity (one process)   |
| iterate(loader, host)      | the host batches  | pinned, copied on a stream| pl.ParallelLoader (.feed: why)   | + the batch's sharding   |
| seed / RNG state           | torch             | + every CUDA generator    | + the XLA generator              | same                     |
| precision_for(mode)        | fp32              | bf16 (>= 8.0) or fp16     | bf16 on TPU, fp32 on XLA:CPU     | same                     |
| profiler                   | torch.profiler    | + CUDA activities         | torch_xla's trace                | same                     |
| data_split()               | (rank, world)     | (rank, world)             | (replica, replicas)              | (host, hosts)            |
| memory() / chip_name()     | None / "cpu"      | allocator / device name   | xm.get_memory_info / device kind | same                     |
| reads_metrics / uses_ddp   | no / yes          | no / yes                  | yes (torch_xla's) / no           | same                     |
| devices_per_process()      | 1                 | 1                         | 1                                | every addressable device |
| step_capture(compile, ...) | eager; "on": torch.compile | torch.compile ("auto": past the payback) | the lazy trace ("on" refused) | same |
| choose_layout(model)       | contiguous ("probe": measured) | channels_last (2-D convs) | contiguous (XLA lays out) | same |
| adamw_options / autotune   | torch's / nothing | fused=True / cuDNN autotuner | capturable=True / nothing | same |

TorchTpuRuntime (torch_tpu.py, kind "torch-tpu": TorchTPU's `tpu` device) is CUDA's column with TorchTPU's names:
eager, the step compiled with backend="tpu", torch.accelerator's synchronize, torch.tpu's generators, bf16 autocast on
"tpu", batches copied as they come, torchrun over the "tpu" process group (docs/backends.md, its column).

layout.py holds the memory-format decision (labkit.runtime.layout). step.py holds the two captures that step_capture() returns (EagerStep, CompiledStep) and says which graphs a
compiled step is made of. One module per family: base.py (Runtime, the CPU), cuda.py (CudaRuntime), xla.py (XlaRuntime on XLA:CPU,
TpuRuntime, and SpmdRuntime / TpuSpmdRuntime; the TPU classes differ from XLA:CPU by precision and chip name
only). Each class names the (kind, spmd) pairs it runs in `backs`, and `Runtime("cuda", device, ...)` builds
the class registered for that kind (labkit.device and labkit.torchrun do), so the kind
string is data (shown, saved in checkpoints), never a branch: the rest of labkit calls these methods.
docs/backends.md lists each seam on every backend, TorchTPU's included (not run here).
"""

from labkit.runtime.base import BackendError, Runtime
from labkit.runtime.cuda import CudaRuntime
from labkit.runtime.torch_tpu import TorchTpuRuntime
from labkit.runtime.xla import SpmdRuntime, TpuRuntime, TpuSpmdRuntime, XlaRuntime

__all__ = [
    "BackendError",
    "CudaRuntime",
    "Runtime",
    "SpmdRuntime",
    "TorchTpuRuntime",
    "TpuRuntime",
    "TpuSpmdRuntime",
    "XlaRuntime",
]
