"""The Trainer under torchrun on a tiny GPT, each run a TrainConfig.parallel plan (labkit.parallel), for notebook 08
and tests/test_fsdp_trainer.py.

    from labkit.lessons import fsdp_trainer
    report = fsdp_trainer.launch(4, [{"name": "a", "parallel": "fsdp2", "steps": 4, "count": True}])   # gloo processes
    report["a"]["comm"]        # {"all-gather": 4.0, ...}: collectives per optimizer step, counted

launch() starts `python -m torch.distributed.run --standalone --nproc-per-node N -m labkit.lessons.fsdp_trainer JOB`
and returns process 0's report. A run is {"name", "parallel", "accum_steps", "merge", "steps", "stop_at", "ckpt",
"checkpoint_every", "resume", "count", "compile", "compile_backend", "clip", "n_embd", "n_layer", "progress", "step_sleep",
"meta" (built by labkit.meta_init), "budget_mb" (LABKIT_MEMORY_MB while the plan is chosen), "fsdp_accumulate",
"sigterm_at" ([rank, step]: that process signals itself after that step)}. Every run trains the same
data: `steps` optimizer steps of GLOBAL rows per micro-batch, split over the processes (each its rows of every
micro-batch). merge=True feeds each process its k micro-batches as one batch (accum_steps=1): the k-times larger
batch, row for row the same. Each run's report: "losses" (process 0's, per step), "global_losses" (per micro-batch,
averaged over the processes: what does not depend on their number), "first_step", "param_bytes" / "opt_bytes" (process
0's shards), "comm" (count=True: {op: count per optimizer step}), "comm_bytes", "comm_by_dim" ({mesh dimension: {op:
[count, bytes] per step}}), "build_mb" (peak RSS of the build and layout), "seconds", "ends" (progress=PATH: each
process's [last step, stopped by SIGTERM], while PATH.RANK holds "PID STEP"), or "error" (a refusal).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

import labkit
from labkit import meta_init
from labkit.checkpoint import CheckpointManager
from labkit.interrupts import Preempted
from labkit.lm import LMTrainer
from labkit.models.gpt import GPT, GPTConfig, adamw
from labkit.parallel import collective_counter
from labkit.parallel import comm_by_dim as collective_counts_by_dim
from labkit.spmd import dtensor_plans as D

GLOBAL, BLOCK, MICRO = 16, 16, 4  # rows per micro-batch over all processes, tokens per row, micro-batches kept


def gpt_config(n_embd: int = 32, n_layer: int = 2) -> GPTConfig:
    """The GPT every run trains: `n_layer` blocks of `n_embd`, 16 tokens, no dropout (the runs compare losses)."""
    return GPTConfig(block_size=BLOCK, n_layer=n_layer, n_head=2, n_embd=n_embd, dropout=0.0)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """The process's peak resident memory (MB) while the block runs, sampled every 2 ms by a thread (Linux)."""

    def __enter__(self):
        self.mb, self._stop = _rss_mb(), threading.Event()

        def sample():
            while not self._stop.wait(0.002):
                self.mb = max(self.mb, _rss_mb())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, _rss_mb())


class Rows:
    """Each rank's rows of a fixed list of global micro-batches; `merge` consecutive ones joined into one batch."""

    def __init__(self, text, rank, world, merge=1):
        self.text, self.rank, self.world, self.merge = text, rank, world, merge
        self.batch_size = GLOBAL // world * merge
        self.dataset = list(range(len(text) * GLOBAL))  # the position checks count samples against it

    def __len__(self):
        return len(self.text) // self.merge

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        each = GLOBAL // self.world
        for i in range(len(self)):
            rows = [
                t[self.rank * each : (self.rank + 1) * each] for t in self.text[i * self.merge : (i + 1) * self.merge]
            ]
            t = torch.cat(rows)
            yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


class GlobalLoss(LMTrainer):
    """Records each micro-batch's loss averaged over the processes (one all-reduce, outside the counted runs): a
    process's own loss depends on which rows it holds, which changes with the number of processes."""

    global_losses: list

    def train_step(self, batch):
        loss = super().train_step(batch)
        if self.global_losses is not None:
            mean = loss.detach().clone()
            if self.rt.world_size > 1:  # one process (a one-file checkpoint's run): its loss is the mean
                dist.all_reduce(mean)
            self.global_losses.append(mean.item() / self.rt.world_size)
        return loss


class Progress:
    """A callback: after each step, `PATH.RANK` holds "PID STEP" (a test signals one process by it); `sleep` seconds
    a step, so that a signal finds the run still going. sigterm_at=(rank, step): that process sends SIGTERM to
    itself after that step, as a preempted host's process gets it (no PID read from a file, which another process
    may hold by the time a signal is sent)."""

    def __init__(self, path, rank, sleep, sigterm_at=None):
        self.path, self.sleep, self.rank, self.sigterm_at = f"{path}.{rank}", sleep, rank, sigterm_at

    def on_step_end(self, trainer, batch):
        with open(self.path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {trainer.step}")
        os.replace(self.path + ".tmp", self.path)
        if self.sigterm_at is not None and list(self.sigterm_at) == [self.rank, trainer.step]:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.sleep)


def run(rt, spec, steps_total):
    k = spec.get("accum_steps", 1)
    merge = k if spec.get("merge") else 1
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 8, (steps_total * MICRO, GLOBAL, BLOCK + 1), generator=g)  # 8 symbols: the loss falls
    text = text[: spec["steps"] * k]  # k micro-batches per optimizer step, merged or not
    gcfg = gpt_config(spec.get("n_embd", 32), spec.get("n_layer", 2))
    cfg = labkit.TrainConfig(
        epochs=1,
        max_steps=spec.get("stop_at", spec["steps"]),
        log_every=1,
        eval_every=0,
        clip_norm=spec.get("clip", 1.0),
        accum_steps=1 if merge > 1 else k,
        parallel=spec["parallel"],
        checkpoint_every=spec.get("checkpoint_every", 0),
        resume=spec.get("resume", False),
        compile=spec.get("compile", "off"),
        compile_backend=spec.get("compile_backend", "inductor"),
        fsdp_accumulate=spec.get("fsdp_accumulate", "auto"),
    )
    ckpt = CheckpointManager(spec["ckpt"], keep=2, rt=rt, async_save=False) if spec.get("ckpt") else None
    loader = Rows(text, rt.ordinal, rt.world_size, merge)
    progress = spec.get("progress") and [
        Progress(spec["progress"], rt.ordinal, spec.get("step_sleep", 0.0), spec.get("sigterm_at"))
    ]
    progress = progress or []
    if spec.get("budget_mb"):  # the per-process memory "auto" plans for (labkit.parallel.device_memory)
        os.environ["LABKIT_MEMORY_MB"] = str(spec["budget_mb"])
    rss0, peak = _rss_mb(), PeakRSS()
    try:
        with peak:  # the build and the layout: a whole copy in each process, then sharded; or (meta) shards only
            if spec.get("meta"):
                model = meta_init.build(lambda: GPT(gcfg), seed=0)
            else:
                torch.manual_seed(0)
                model = GPT(gcfg)
            opt = adamw(model, 1e-2, rt=rt)
            trainer = GlobalLoss(model, opt, rt, cfg, loader, checkpoint=ckpt, callbacks=progress)
    finally:
        os.environ.pop("LABKIT_MEMORY_MB", None)
    build_mb = peak.mb - rss0
    mode = collective_counter() if spec.get("count") else None
    trainer.global_losses = None if mode is not None else []
    t0, preempted = time.perf_counter(), False
    try:
        with mode if mode is not None else contextlib.nullcontext():
            trainer.fit()
    except Preempted:  # SIGTERM to one process: every process stopped at one step and saved it
        preempted = True
    seconds = time.perf_counter() - t0
    if ckpt is not None:
        ckpt.close()
    params = {n: p for n, p in trainer.module.named_parameters()}
    mine = sum(D.local(p).numel() * p.element_size() for p in params.values())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    opt_mine = sum(D.local(v).numel() * v.element_size() for v in state)
    done = trainer.step - (trainer.history[0]["step"] - 1 if trainer.history else 0)
    out = {
        "plan": trainer.plan.describe(),
        "losses": [r["loss"] for r in trainer.history],  # process 0's
        "global_losses": trainer.global_losses,  # per micro-batch, the mean over the processes
        "first_step": trainer.history[0]["step"] if trainer.history else None,
        "seconds": round(seconds, 2),
        "param_bytes": mine,
        "opt_bytes": opt_mine,
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "placements": sorted({D.placement(p) for p in params.values()}),
        "keys": sorted(trainer.module.state_dict())[:3],
        "build_mb": round(build_mb, 1),  # peak RSS during build + layout, above the process's RSS before it
    }
    if progress and rt.world_size > 1:  # each process's last step and whether fit() ended in Preempted
        ends = [None] * rt.world_size
        dist.all_gather_object(ends, [trainer.step, preempted])
        out["ends"] = ends
    if mode is not None and getattr(trainer.plan, "mesh", None) is not None:  # which collectives crossed hosts
        by_dim = collective_counts_by_dim(mode, trainer.plan.mesh)
        out["comm_by_dim"] = {d: {op: [c / done, b / done] for op, (c, b) in v.items()} for d, v in by_dim.items()}
    if mode is not None:
        out["comm"] = {op: v["count"] / done for op, v in D.comm_counts(mode).items()}
        out["comm_bytes"] = {op: v["bytes"] / done for op, v in D.comm_counts(mode).items()}
    return out


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    rt = labkit.setup("cpu")  # under torchrun: one gloo process per rank
    steps_total = max(r["steps"] for r in job["runs"])
    report = {}
    for spec in job["runs"]:
        try:
            report[spec["name"]] = run(rt, spec, steps_total)
        except Exception as e:  # a refusal a test expects: its message, on every rank alike
            report[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        rt.rendezvous("fsdp-trainer-run")
    if rt.is_master:
        with open(job["out"], "w") as f:
            json.dump(report, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, runs: list, timeout_s: float = 300, log_path: str | None = None) -> dict:
    """Run `runs` in order in one torchrun of `nproc` gloo processes; process 0's report {name: result}. The whole
    process group is killed on a timeout or a failure; RuntimeError with the log's last lines then."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labkit's parent folder
    with tempfile.TemporaryDirectory(prefix="labkit-fsdp-") as tmp:
        job = {"out": os.path.join(tmp, "out.json"), "runs": runs}
        path = os.path.join(tmp, "job.json")
        with open(path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LABKIT_PARALLEL", "LABKIT_BACKEND", "CPU_NUM_DEVICES"):
            env.pop(var, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}"]
        cmd += ["-m", "labkit.lessons.fsdp_trainer", path]
        with open(log_path or os.path.join(tmp, "log.txt"), "w+") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = f"timed out after {timeout_s} s"
            finally:
                if proc.poll() is None:  # torchrun and its workers: the whole group
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-15:])
        if code != 0 or not os.path.exists(job["out"]):
            raise RuntimeError(f"torchrun of {nproc} processes failed (exit {code}):\n{tail}")
        with open(job["out"]) as f:
            return json.load(f)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
