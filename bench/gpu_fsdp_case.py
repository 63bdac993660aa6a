"""FSDP2 on one GPU through labkit's own code, the parts a GPU node runs that gloo on the CPU cannot show: one process,
world size 1, `init_process_group("cpu:gloo,cuda:nccl")` (the CPU group for labkit's small votes, NCCL for the model).

    python bench/gpu_fsdp_case.py --device cuda      # scripts/gpu_check.sh; --device cpu: the same on gloo alone

1. a ResNet-18 laid out by labkit.parallel.FullyShard in bf16 (its MixedPrecisionPolicy; each residual block a unit,
   the BatchNorms of each block one float32 unit of their own, as the Trainer gets them): one forward + backward and
   an AdamW step on the device, in channels_last batches;
2. materialize on the device: the same model built on the meta device (labkit.meta_init), sharded by the same plan,
   then given memory there (the shards filled as a CPU build of the seed fills them);
3. the agreed sharded save of labkit.checkpoint (CheckpointManager's save under torchrun: the lock, one agreement,
   the shards staged into the manager's CpuMirror, pinned host tensors on CUDA, then DCP's async_save; the commit in
   the writer's thread): the seconds it blocks the loop (the stall), the seconds until it is committed, the mirror's
   host bytes; then the step restored into the live model and compared.
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

    from labkit import meta_init
    from labkit.checkpoint import CheckpointManager
    from labkit.parallel import FullyShard
    from labkit.precision import choose
    from labkit.runtime import Runtime

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    rt = Runtime(a.device, dev, 1, 0, 0, 1, False, {})
    prec = choose(rt, "bf16" if a.device == "cuda" else "fp32")  # bf16 on a CPU is refused where it does not pay
    failed = 0

    def case(name, fn):
        nonlocal failed
        try:
            print(f"CASE {name}: ok {fn() or ''}", flush=True)
        except Exception as e:  # noqa: BLE001 - every part is reported, the next still runs
            failed += 1
            print(f"CASE {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", flush=True)

    state = {}

    def plan_step(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan = FullyShard(rt, prec)
        model = plan.wrap(model, opt)
        x = torch.randn(8, 3, 64, 64, device=dev).contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,), device=dev))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt, plan, loss

    def sharded_bf16():
        torch.manual_seed(0)
        model, opt, plan, loss = plan_step(torchvision.models.resnet18(num_classes=10).to(dev))
        state.update(model=model, opt=opt, plan=plan)
        w = model.conv1.weight
        return f"loss {loss.item():.4f}, {len(plan.units)} units, {plan.describe()}, weight {type(w).__name__} on {w.device}"

    def materialize():
        model = meta_init.build(lambda: torchvision.models.resnet18(num_classes=10), seed=0)
        model, _, _, loss = plan_step(model)
        w = model.conv1.weight.to_local()
        return f"conv1 on {w.device}, finite {bool(torch.isfinite(w).all())}, loss {loss.item():.4f}"

    def agreed_save():
        model, opt, plan = state["model"], state["opt"], state["plan"]
        folder = tempfile.mkdtemp(prefix="gpu-fsdp-case-")
        try:
            ck = CheckpointManager(folder, rt=rt, keep=1, best_metric=None, format="sharded", async_save=True)
            sd = {"model": plan.model_state(model), "optimizer": plan.optimizer_state(model, opt), "step": 1}
            fmt = ck.formats["sharded"]
            t = time.perf_counter()
            # CheckpointManager.save's path under torchrun (one process here: save() would take the one-process one)
            ck._save_together(fmt, 1, sd, {}, None)
            stall = time.perf_counter() - t
            ck.wait()
            done = time.perf_counter() - t
            mirror_mb = fmt.mirror.nbytes / 2**20
            print(f"STALL fsdp2 async save (labkit's agreed sharded save) blocked the loop {stall * 1e3:.1f} ms, committed after {done:.2f} s, "
                  f"mirror {mirror_mb:.1f} MB of host memory", flush=True)  # fmt: skip
            before = {k: v.full_tensor().clone() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            got = ck._restore_together(None, {"model": plan.model_state(model)}, "cpu")
            plan.load_model_state(model, got["model"])
            after = model.state_dict()
            same = all(torch.equal(before[k], after[k].full_tensor()) for k in before)
            ck.close()
            return f"{len(os.listdir(os.path.join(folder, fmt.name(1))))} files, restored equal {same}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    case("fsdp2 bf16 by labkit's FullyShard, float32 BatchNorm units, forward + backward + step", sharded_bf16)
    case("materialize a meta-built model on the device, sharded by the plan", materialize)
    case("labkit's agreed sharded save (CpuMirror staging) and its restore", agreed_save)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
