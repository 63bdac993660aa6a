"""The CPU copy a sharded save stages before it writes: labkit's CpuMirror (labkit.checkpoint.staging) against
torch's own stager with its cache (FileSystemWriter(cache_staged_state_dict=True), DCP's BlockingAsyncStager;
without CUDA its cache cannot pin, and the uncached stager is timed instead).

    python bench/bench_stage.py --device cuda          # a GPU: pinned mirrors on both sides
    python bench/bench_stage.py --device cpu --mb 16   # the same code path on the CPU (no pinning)

The state: --tensors float32 tensors of --mb MB in all on --device, as one process's shards of weights and
optimizer state. Both stagers keep their host tensors from one save to the next: the first call of each (which
allocates them) is left out, and each figure is the median of --repeats calls after it. labkit's copies are issued
non_blocking into pinned memory with one synchronize per device; torch's are blocking, one per tensor. labkit's NaN
check (first_nonfinite: per-tensor verdicts stacked, one read per device) is timed on its own and against the
per-tensor check it replaced (bool(t.isfinite().all()): one read per tensor).
The last line is the figure scripts/gpu_check.sh collects:
    RATIO stage torch/labkit <x> (<device>, <mb> MB in <n> tensors)
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from labkit.checkpoint.staging import CpuMirror, first_nonfinite  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after one call left out (it allocates)."""
    fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def per_tensor_check(state) -> str | None:
    for name, t in state.items():
        if t.is_floating_point() and not bool(t.isfinite().all()):
            return name
    return None


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mb", type=float, default=None, help="MB in all (default: 512 on cuda, 16 on cpu)")
    ap.add_argument("--tensors", type=int, default=160, help="how many tensors (ResNet-50's state: ~160 x 2)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    mb = args.mb or (512 if device.type == "cuda" else 16)
    each = max(1, int(mb * 2**20 / 4 / args.tensors))
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(each, generator=g).to(device) for i in range(args.tensors)}
    total = each * 4 * args.tensors / 2**20

    mirror = CpuMirror()
    with tempfile.TemporaryDirectory() as tmp:
        # torch's cache pins its host tensors whatever the device: without CUDA it cannot run, and its uncached
        # stager (new host tensors every save) is the one a CPU run compares with
        cache = torch.cuda.is_available()
        torch_stager = FileSystemWriter(tmp, cache_staged_state_dict=cache)
        ours = timed(lambda: mirror.stage(state), device, args.repeats)
        theirs = timed(lambda: torch_stager.stage(state), device, args.repeats)
    check = timed(lambda: first_nonfinite(state), device, args.repeats)
    check_each = timed(lambda: per_tensor_check(state), device, args.repeats)
    staged = mirror.stage(state)
    assert all(torch.equal(staged[k], state[k].cpu()) for k in state), "the mirror does not hold the state"
    pinned = all(t.is_pinned() for t in staged.values())
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), state "
        f"{total:.0f} MB in {args.tensors} float32 tensors, median of {args.repeats} after one left out"
    )
    print(f"labkit CpuMirror.stage      {ours * 1e3:9.2f} ms  {total / 1024 / ours:6.2f} GB/s  pinned={pinned}")
    print(f"torch cache_staged_state_dict={cache} {theirs * 1e3:7.2f} ms  {total / 1024 / theirs:6.2f} GB/s")
    print(f"NaN check stacked            {check * 1e3:8.2f} ms   per tensor {check_each * 1e3:8.2f} ms")
    ratio = theirs / ours
    print(f"RATIO stage torch/labkit {ratio:.2f} ({device.type}, {total:.0f} MB in {args.tensors} tensors)")
    return ratio


if __name__ == "__main__":
    main()
