"""FSDP2 on one GPU, the parts a GPU node runs that gloo on the CPU cannot show: one process, world size 1,
`init_process_group("cpu:gloo,cuda:nccl")` (the CPU group for labkit's small votes, NCCL for the model).

    python bench/gpu_fsdp_case.py --device cuda      # scripts/gpu_check.sh; --device cpu: the same on gloo alone

1. a ResNet-18 under fully_shard in bf16 (MixedPrecisionPolicy), each BatchNorm its own float32 unit (labkit.parallel's
   rule): one forward + backward on the device, in channels_last batches;
2. materialize on the device: the same model built on the meta device (labkit.meta_init) and given memory there;
3. async_save of the sharded state (CUDA DTensors staged to the host): the seconds the call blocks the loop (the
   stall) and the seconds until the write is done.
Prints a CASE line per part (ok, or the error) and STALL with the seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    failed = 0

    def case(name, fn):
        nonlocal failed
        try:
            print(f"CASE {name}: ok {fn() or ''}", flush=True)
        except Exception as e:  # noqa: BLE001 - every part is reported, the next still runs
            failed += 1
            print(f"CASE {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", flush=True)

    state = {}

    def sharded_bf16():
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).to(dev)
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False))
        for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
            fully_shard(layer, mp_policy=bf16)
        fully_shard(model, mp_policy=bf16)
        x = torch.randn(8, 3, 64, 64, device=dev).contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,), device=dev))
        loss.backward()
        state["model"] = model
        return f"loss {loss.item():.4f}, weight {type(model.conv1.weight).__name__} on {model.conv1.weight.device}"

    def materialize():
        from labkit import meta_init

        model = meta_init.build(lambda: torchvision.models.resnet18(num_classes=10))
        meta_init.materialize(model, dev)
        return f"conv1 on {model.conv1.weight.device}, finite {bool(torch.isfinite(model.conv1.weight).all())}"

    def async_save():
        import torch.distributed.checkpoint as dcp

        sd = {"model": state["model"].state_dict()}  # the sharded model of the first part: DTensors on the device
        folder = tempfile.mkdtemp(prefix="gpu-fsdp-case-")
        t = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=folder)
        stall = time.perf_counter() - t
        fut.result()
        done = time.perf_counter() - t
        print(f"STALL fsdp2 async_save blocked the loop {stall * 1e3:.1f} ms, written after {done:.2f} s", flush=True)
        files = len(os.listdir(folder))
        shutil.rmtree(folder, ignore_errors=True)
        return f"{files} files"

    case("fsdp2 bf16 with float32 BatchNorm units, forward + backward", sharded_bf16)
    case("materialize a meta-built model on the device", materialize)
    case("async_save of the sharded state", async_save)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
