"""TorchTPU's API contract, checked with the real torch-tpu package (run by tests/children/image_job.py in the
simulated TorchTPU image, with that venv's Python and this checkout on PYTHONPATH; no TPU chip).

    .venvs/torchtpu-vm/bin/python tests/children/torch_tpu_contract.py OUT.json

Writes what tests/test_images.py asserts on: each name labkit calls (labkit.runtime.torch_tpu.CALLS) found and
callable with the parameters labkit passes; "tpu" among torch.compile's backends; the "tpu" process-group backend as
torch_tpu registers it; labkit's line and its CPU runtime where there is no chip; a CPU backward's seconds (the
parent's timeout is the hang guard: libtpu's metadata-server retries, which labkit's no_chip_settings stop).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time

out_path = sys.argv[1]
result: dict = {"problems": []}
problems = result["problems"]

env_before = os.environ.get("TPU_SKIP_MDS_QUERY")
t0 = time.perf_counter()
import labkit  # noqa: E402  (first: it sets what keeps libtpu off the metadata server, before torch starts)

result["env_set_by_labkit"] = os.environ.get("TPU_SKIP_MDS_QUERY") if env_before is None else "set before"
import torch  # noqa: E402

result["import_s"] = time.perf_counter() - t0
result["torch"] = torch.__version__
result["torch_tpu_loaded"] = "torch_tpu" in sys.modules and hasattr(torch, "tpu")

from labkit.runtime import torch_tpu as ltt  # noqa: E402


def resolve(dotted: str):
    obj = sys.modules[dotted.split(".")[0]]
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


calls = {}
for name, params in ltt.CALLS.items():
    try:
        fn = resolve(name)
    except Exception as e:  # noqa: BLE001 - a missing name is the finding
        problems.append(f"{name}: not found ({type(e).__name__}: {e})")
        continue
    if not callable(fn):
        problems.append(f"{name}: not callable ({type(fn).__name__})")
        continue
    sig = inspect.signature(fn)
    try:
        sig.bind(*[object()] * len(params))  # labkit passes these positionally
    except TypeError as e:
        problems.append(f"{name}{sig}: does not take labkit's {len(params)} positional argument(s) {params}: {e}")
    calls[name] = str(sig)
result["calls"] = calls

result["compile_backends_has_tpu"] = ltt.COMPILE_BACKEND in torch._dynamo.list_backends()
if not result["compile_backends_has_tpu"]:
    problems.append(f"torch.compile backend {ltt.COMPILE_BACKEND!r} is not registered")

# The process-group backend: torch_tpu's loader registers it (with tpu_distributed.create_process_group) when its
# autoload finds chips. Here, without chips: the registration's code and its callable, then the registration itself
# done as the loader does it, so that torch.distributed knows the name labkit passes to init_process_group.
import torch.distributed as dist  # noqa: E402
import torch_tpu._loader as loader  # noqa: E402

source = inspect.getsource(loader._init_device_impl)
registered = re.findall(r'register_backend\(\s*"(\w+)",\s*tpu_distributed\.create_process_group', source)
result["loader_registers"] = registered
if ltt.PROCESS_GROUP not in registered:
    problems.append(f"torch_tpu._loader._init_device_impl does not register {ltt.PROCESS_GROUP!r}: {registered}")
result["registered_without_chips"] = ltt.PROCESS_GROUP in dist.Backend.backend_list
try:
    from torch_tpu._internal.distributed import tpu_distributed

    dist.Backend.register_backend(ltt.PROCESS_GROUP, tpu_distributed.create_process_group, devices=["tpu"])
    result["process_group_backend"] = (
        ltt.PROCESS_GROUP in dist.Backend.backend_list and dist.Backend(ltt.PROCESS_GROUP) == ltt.PROCESS_GROUP
    )
except Exception as e:  # noqa: BLE001
    problems.append(f"registering {ltt.PROCESS_GROUP!r} as torch_tpu's loader does failed: {type(e).__name__}: {e}")
    result["process_group_backend"] = False

# No chip: labkit says so in one line and runs on the CPU
import contextlib  # noqa: E402
import io  # noqa: E402

buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rt = labkit.setup()
result["runtime"] = {"kind": rt.kind, "device": str(rt.device)}
result["setup_printed"] = buf.getvalue()
result["chips"] = ltt.chips()

t = time.perf_counter()
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model(torch.randn(32, 64)).sum().backward()
result["backward_s"] = time.perf_counter() - t

with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
