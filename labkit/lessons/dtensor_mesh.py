"""Notebook 03's GPT laid out with DTensor (FSDP2's fully_shard, parallelize_module) on 4 CPU processes, beside
the same plans under GSPMD on 4 virtual XLA:CPU devices: bytes per device, layouts, losses, collectives.

    from labkit.lessons import dtensor_mesh
    report = dtensor_mesh.run()     # ~90 s of CPU (1.5-3.5 min on a busy 2-core machine): a torchrun + an XLA child
    print(dtensor_mesh.describe(report))         # per plan: bytes per device on both engines, losses, collectives
    dtensor_mesh.compare(report)                 # [{"plan", "dtensor_bytes", "gspmd_bytes", "loss_diff", ...}]

Two engines, one model, the same batches and initial weights:
- DTensor: one process per device (here `torchrun --nproc_per_node=4`, gloo over the CPU; TorchTPU's engine, and
  torch's on GPUs). Each process holds its shards as DTensors and issues the collectives itself, eagerly; they are
  counted with torch.distributed.tensor.debug.CommDebugMode over one step. The plans: labkit.spmd.dtensor_plans.
- GSPMD: one process drives all devices, the compiler partitions the step (labkit.lessons.parallel_gpt, as in
  notebook 03), in a second child (a process that runs torch_xla cannot switch to a mesh later).

The losses agree to float32 rounding, not bit for bit: XLA fuses and orders its sums differently from eager
PyTorch, and each plan splits the sums over devices at different places (a gradient summed by a reduce-scatter,
an activation by an all-reduce), so the additions happen in another order; AdamW then carries the difference on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from labkit.spmd.dtensor_plans import PLANS

# notebook 03's fast-mode GPT (LABKIT_FAST=1): what its four GSPMD runs train
FAST_GPT = {"n_layer": 1, "n_head": 4, "n_embd": 32, "block_size": 16}
LOSS_TOL = 1e-4  # nats between engines or plans after 3 AdamW steps (measured: 1e-6; why not 0: the module docstring)


def run(
    cfg: dict | None = None,
    batches=None,
    steps: int = 3,
    batch_size: int = 16,
    lr: float = 3e-2,
    seed: int = 0,
    devices: int = 4,
    model_axis: int = 2,
    plans=PLANS,
    gspmd: bool | None = None,
    timeout_s: float = 600,
) -> dict:
    """Train GPTConfig(**cfg) (default FAST_GPT) for `steps` AdamW steps under each plan, on `devices` gloo
    processes (one torchrun) and under parallel_gpt's strategies of the same names on `devices` virtual XLA:CPU
    devices (gspmd=None: wherever torch_xla is installed, which Colab's GPU image is not). batches: a list of (x, y)
    int64 tensors of the global batch; by default `steps` seeded random batches of `batch_size` sequences over 8
    symbols, so the loss falls visibly in 3 steps.

    Returns {"devices", "config", "single_losses" (one process, whole batch),
    "dtensor": {plan: {"mesh", "rows": [[name, shape, local shape, placement, split dims, bytes]],
        "param_bytes" (the fullest device), "bytes_by_rank", "padded_bytes" (FSDP2's own padded storage, or None),
        "opt_bytes", "losses", "collectives": {op: {"count", "bytes"}} of the last step (CommDebugMode),
        "predicted" (dtensor_plans.predict_collectives), "textbook" (notebook 03's per-parameter prediction)}},
    "padding": a (10, 3) weight under FSDP2 {"shape", "rows_by_rank", "padded_rows"},
    "gspmd": {plan: {"param_bytes", "opt_bytes", "losses", "rows": [[name, shape, per-device shape, sharding,
        split dims]]}} ({} when GSPMD did not run, and "gspmd_skipped" says why),
    "seconds": {"dtensor", "gspmd"}: each child's wall time}.
    Raises RuntimeError with the failing child's last lines."""
    import torch

    cfg = dict(FAST_GPT if cfg is None else cfg)
    if batches is None:
        g = torch.Generator().manual_seed(seed)
        text = torch.randint(0, 8, (steps, batch_size, cfg["block_size"] + 1), generator=g)
        batches = [(t[:, :-1], t[:, 1:]) for t in text]
    plans = [str(p) for p in plans]
    unknown = sorted(set(plans) - set(PLANS))
    if unknown:
        raise ValueError(f"plans must be among {PLANS}, got {unknown}")
    with tempfile.TemporaryDirectory(prefix="labkit-dtensor-") as tmp:
        job = {
            "cfg": cfg,
            "batches": os.path.join(tmp, "batches.pt"),
            "lr": float(lr),
            "seed": int(seed),
            "devices": int(devices),
            "model_axis": int(model_axis),
            "plans": plans,
        }
        torch.save([(x.cpu(), y.cpu()) for x, y in batches], job["batches"])
        report = {"devices": int(devices), "config": cfg, "seconds": {}, "gspmd": {}}
        children = []
        no_xla = "torch_xla is not installed here" if importlib.util.find_spec("torch_xla") is None else None
        if gspmd and no_xla:
            raise RuntimeError(no_xla + ": run(gspmd=False) runs the DTensor side alone")
        if gspmd is False or no_xla:
            report["gspmd_skipped"] = no_xla or "gspmd=False"
        else:  # both children at once: on a machine with cores to spare the run takes the longer of the two
            env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(int(devices)), "LABKIT_BACKEND": "xla-cpu"}
            env["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
            children.append(_start([sys.executable], "gspmd", job, tmp, env))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}"]
        children.append(_start(torchrun, "dtensor", job, tmp, {"OMP_NUM_THREADS": "1"}))
        deadline = time.perf_counter() + timeout_s
        try:
            for child in reversed(children):  # the DTensor run first: it is the shorter
                kind, result, seconds = _finish(child, deadline)
                if kind == "dtensor":
                    report.update(result)
                else:
                    report["gspmd"] = result
                report["seconds"][kind] = seconds
        finally:
            for _kind, proc, *_ in children:
                if proc.poll() is None:  # a failure or a timeout: the child's whole group (torchrun's workers too)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return report


def _start(launcher: list, kind: str, job: dict, tmp: str, env: dict):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labkit's parent folder
    out = os.path.join(tmp, f"{kind}.json")
    path = os.path.join(tmp, f"{kind}-job.json")
    with open(path, "w") as f:
        json.dump(dict(job, out=out), f)
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    log = open(os.path.join(tmp, f"{kind}.log"), "w+")  # a file, not a pipe: nothing blocks on a full buffer
    cmd = launcher + ["-m", "labkit.lessons.dtensor_mesh", kind, path]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return kind, proc, log, out, time.perf_counter()


def _finish(child, deadline: float):
    """(kind, the child's result, seconds it ran); RuntimeError with its last lines when it failed."""
    kind, proc, log, out, t0 = child
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        code = "timed out"
    log.seek(0)
    lines = log.read().strip().splitlines()
    tail = lines[-12:]  # torchrun's summary; a process's own last words come before it:
    said = [ln for ln in lines[:-12] if "terminate called" in ln or "Error" in ln or "error:" in ln][-6:]
    tail = said + (["..."] if said else []) + tail
    log.close()
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"the {kind} run failed (exit {code}):\n" + "\n".join(tail))
    with open(out) as f:
        return kind, json.load(f), round(time.perf_counter() - t0, 1)


def compare(report: dict, tol: float = LOSS_TOL) -> list[dict]:
    """Per plan run on both engines: {"plan", "dtensor_bytes", "gspmd_bytes", "same_bytes", "loss_diff" (largest
    step-by-step difference, nats), "same_losses" (within `tol`), "layout_differs": [[parameter, dims DTensor
    splits, dims GSPMD splits]]}."""
    out = []
    for plan, d in report["dtensor"].items():
        g = report["gspmd"].get(plan)
        if g is None:
            continue
        diff = max(abs(a - b) for a, b in zip(d["losses"], g["losses"]))
        gdims = {row[0]: row[4] for row in g["rows"]}
        differs = [[row[0], row[4], gdims[row[0]]] for row in d["rows"] if row[0] in gdims and row[4] != gdims[row[0]]]
        out.append(
            {
                "plan": plan,
                "dtensor_bytes": d["param_bytes"],
                "gspmd_bytes": g["param_bytes"],
                "same_bytes": d["param_bytes"] == g["param_bytes"] and d["opt_bytes"] == g["opt_bytes"],
                "loss_diff": diff,
                "same_losses": len(d["losses"]) == len(g["losses"]) and diff <= tol,
                "layout_differs": differs,
            }
        )
    return out


def describe(report: dict) -> str:
    """The comparison in words: one paragraph per plan."""
    n = report["devices"]
    lines = [f"one process, whole batch: losses {_fmt(report['single_losses'])}"]
    for row in compare(report) or [{"plan": p} for p in report["dtensor"]]:
        d = report["dtensor"][row["plan"]]
        lines.append(f"{row['plan']} on {n} devices, mesh {d['mesh']}:")
        padded = f" (FSDP2's padded storage: {d['padded_bytes']:,d})" if d.get("padded_bytes") is not None else ""
        lines.append(f"  DTensor: {d['param_bytes']:,d} parameter bytes per device{padded}, AdamW {d['opt_bytes']:,d}")
        if "gspmd_bytes" in row:
            g = report["gspmd"][row["plan"]]
            lines.append(f"  GSPMD:   {g['param_bytes']:,d} parameter bytes per device, AdamW {g['opt_bytes']:,d}")
            lines.append(
                f"  losses DTensor {_fmt(d['losses'])}, GSPMD {_fmt(g['losses'])}: {row['loss_diff']:.1e} apart"
            )
            for name, dt, gs in row["layout_differs"]:
                lines.append(f"  {name}: DTensor splits dims {dt}, GSPMD dims {gs}")
        lines.append(f"  collectives in one step: {_ops(d['collectives'])}; predicted: {_ops(d['predicted'])}")
    p = report["padding"]
    lines.append(
        f"uneven: a {tuple(p['shape'])} weight under FSDP2 on {n} devices: rows per device {p['rows_by_rank']}, "
        f"each stores {p['padded_rows']} rows (padding)"
    )
    return "\n".join(lines)


def _ops(ops: dict) -> str:
    return ", ".join(f"{v['count']} {k} ({v['bytes']:,d} bytes)" for k, v in sorted(ops.items())) or "none"


def _fmt(losses) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in losses) + "]"


# -- the children -------------------------------------------------------------------------------------------------
def _load(job):
    import torch

    from labkit.models.gpt import GPTConfig

    return GPTConfig(dropout=0.0, **job["cfg"]), torch.load(job["batches"])


def _dtensor_child(job: dict) -> dict | None:
    """In each of torchrun's processes: the single-process reference (rank 0), then every plan in turn."""
    import contextlib

    import torch
    import torch.distributed as dist

    from labkit.models.gpt import GPT
    from labkit.spmd import dtensor_plans as D

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, batches = _load(job)
    global_batch = batches[0][0].shape[0]

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=job["lr"], betas=(0.9, 0.95), weight_decay=0.0, foreach=False)

    def train(model, rows, after_backward=None, count_last=False):
        opt, losses, mode = adamw(model), [], None
        for i, (x, y) in enumerate(batches):
            mode = D.comm_mode() if count_last and i == len(batches) - 1 else contextlib.nullcontext()
            with mode:
                _, loss = model(x[rows], y[rows])
                loss.backward()
                if after_backward:
                    after_backward(model)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return opt, torch.stack(losses), mode

    report = {}
    if rank == 0:
        torch.manual_seed(job["seed"])
        _, single, _ = train(GPT(cfg), slice(None))
        report["single_losses"] = single.tolist()
    report["dtensor"] = {}
    for plan in job["plans"]:
        mesh = D.make_mesh(plan, world, job["model_axis"])
        torch.manual_seed(job["seed"])
        model = GPT(cfg) if plan != "tensor" else D.tensor_parallel_model(GPT(cfg))
        D.apply_plan(plan, model, mesh)
        sync = None
        if plan == "tensor":  # the batch is split over "data": each slice's gradients averaged over it
            data = mesh["data"]
            k, parts, group = data.get_local_rank(), data.size(), data.get_group()

            def sync(m, parts=parts, group=group):
                for p in m.parameters():
                    g = D.local(p.grad)
                    dist.all_reduce(g, group=group)
                    g.div_(parts)
        else:
            k, parts = rank, world
        each = global_batch // parts
        opt, losses, mode = train(model, slice(k * each, (k + 1) * each), sync, count_last=True)
        dist.all_reduce(losses)  # each process saw its slice: the global mean is the mean of the slices'
        losses /= world
        params = dict(model.named_parameters())
        mine = sum(D.local(p).numel() * p.element_size() for p in params.values())
        state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        opt_mine = sum(D.local(v).numel() * v.element_size() for v in state)
        totals = [None] * world
        dist.all_gather_object(totals, (mine, opt_mine))
        report["dtensor"][plan] = {
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
            "rows": [
                [
                    name,
                    list(p.shape),
                    list(D.local(p).shape),
                    D.placement(p),
                    list(D.split_dims(p.shape, D.local(p).shape)),
                    D.local(p).numel() * p.element_size(),
                ]
                for name, p in params.items()
            ],
            "param_bytes": max(t[0] for t in totals),
            "bytes_by_rank": [t[0] for t in totals],
            "padded_bytes": D.padded_bytes(model),
            "opt_bytes": max(t[1] for t in totals),
            "losses": losses.tolist(),
            "collectives": D.comm_counts(mode),
            "predicted": D.predict_collectives(plan, cfg, world, global_batch, job["model_axis"]),
            "textbook": D.textbook_collectives(plan, cfg, world, global_batch, job["model_axis"]),
        }
    report["padding"] = D.padding_probe(world)
    dist.destroy_process_group()
    return report if rank == 0 else None


def _gspmd_child(job: dict) -> dict:
    """One process, `devices` virtual XLA:CPU devices: notebook 03's strategies of the same names."""
    import labkit
    from labkit.lessons import parallel_gpt as PG
    from labkit.spmd import dtensor_plans as D

    labkit.setup("xla-cpu", spmd=True)
    cfg, batches = _load(job)
    out = {}
    for plan in job["plans"]:
        r = PG.train(PG.Strategy(plan, model_axis=job["model_axis"]), cfg, batches, lr=job["lr"], seed=job["seed"])
        out[plan] = {
            "param_bytes": r.param_bytes,
            "opt_bytes": r.opt_bytes,
            "losses": r.losses,
            "rows": [[n, list(s), list(sh), spec, list(D.split_dims(s, sh))] for n, s, sh, spec in r.layout],
        }
    return out


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        job = json.load(f)
    result = _dtensor_child(job) if kind == "dtensor" else _gspmd_child(job)
    if result is not None:
        with open(job["out"], "w") as f:
            json.dump(result, f)
    if kind == "dtensor":
        # Every result is written and the process group destroyed. torch 2.11's gloo then aborted one process in
        # several at the interpreter's teardown ("terminate called without an active exception", SIGABRT; 1 run in
        # 10 to 2 in 3 here, torch 2.9 never), and torchrun reported the whole run failed. Leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
