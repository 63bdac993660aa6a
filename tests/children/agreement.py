"""Run under torchrun by tests/test_agreement.py: decisions, failures and waits that every process shares, each a
case on 2 gloo processes (FSDP2 on labkit.lessons.fsdp_trainer's tiny GPT and data).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/children/agreement.py JOB.json

JOB.json: {"out": PATH, "runs": [{"name", "case", ...}, ...]}, in order. Each case returns a dict on every process;
the report holds, per name, the list of every process's dict (an exception: {"error": its text}). The report is
written after each case, so a launch stopped by a hang still shows what finished.
"""

import json
import os
import signal
import sys
import traceback
import warnings
import zlib

import torch
import torch.distributed as dist

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.lessons.fsdp_trainer import GlobalLoss, Rows, gpt_config
from labkit.models.gpt import GPT, adamw


def trainer_for(rt, spec, callbacks=(), ckpt=None):
    g = torch.Generator().manual_seed(1)
    steps = spec.get("steps", 6) + (rt.ordinal in spec.get("a_step_more_on", []))  # one more batch here
    text = torch.randint(0, 8, (steps * spec.get("accum_steps", 1), 16, 17), generator=g)
    torch.manual_seed(0)
    model = GPT(gpt_config())
    cfg = labkit.TrainConfig(
        epochs=spec.get("epochs", 1),
        max_steps=spec.get("stop_at", spec.get("steps", 6)),
        log_every=1,
        eval_every=spec.get("eval_every", 0),
        clip_norm=1.0,
        parallel=spec.get("parallel", "fsdp2"),
        accum_steps=spec.get("accum_steps", 1),
        checkpoint_every=spec.get("checkpoint_every", 1000),
        resume=spec.get("resume", False),
    )
    loader = Rows(text, rt.ordinal, rt.world_size)
    if rt.ordinal in spec.get("more_data_on", []):  # another dataset on this process: 16 samples more
        loader.dataset = loader.dataset + list(range(16))
    lr = spec.get("lr", [1e-2] * rt.world_size)[rt.ordinal]  # one per process
    evals = Rows(text[:2], rt.ordinal, rt.world_size) if cfg.eval_every else None
    trainer = GlobalLoss(
        model, adamw(model, lr, rt=rt), rt, cfg, loader, evals, callbacks=list(callbacks), checkpoint=ckpt
    )
    trainer.global_losses = None
    return trainer


def checksum(module) -> int:
    """crc32 of this process's parameter shards: equal before and after means the model was not touched."""
    crc = 0
    for _, p in sorted(module.named_parameters()):
        t = p.to_local() if hasattr(p, "to_local") else p
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return crc


def fit(rt, trainer):
    """fit(), then the manager closed; {"step", "error"?}."""
    out = {}
    try:
        trainer.fit()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if trainer.checkpoint is not None:
            try:
                trainer.checkpoint.close()
            except Exception as e:
                out.setdefault("error", f"{type(e).__name__}: {e}")
    out["step"] = trainer.step
    return out


# -- the cases -------------------------------------------------------------------------------------------------
def case_plan(rt, spec):
    """LABKIT_MEMORY_MB differs per process (budget_mb: one per process) while "auto" picks the plan and the
    accumulation mode."""
    os.environ["LABKIT_MEMORY_MB"] = str(spec["budget_mb"][rt.ordinal])
    try:
        trainer = trainer_for(rt, spec)
    finally:
        os.environ.pop("LABKIT_MEMORY_MB", None)
    out = fit(rt, trainer)
    out["plan"] = trainer.plan.describe()
    return out


class Asks:
    """A callback whose on_log (process 0 only) asks for a checkpoint at `save_at` and a stop at `stop_at`."""

    def __init__(self, save_at, stop_at):
        self.save_at, self.stop_at = save_at, stop_at

    def on_log(self, trainer, rec):
        if rec["step"] == self.save_at:
            trainer.request_checkpoint()
        if rec["step"] == self.stop_at:
            trainer.request_stop()


def case_asks(rt, spec):
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=False)
    trainer = trainer_for(rt, spec, [Asks(spec["save_at"], spec["ask_stop_at"])], ckpt)
    out = fit(rt, trainer)
    out["saved"] = sorted(n for n in os.listdir(spec["ckpt"]) if n.startswith("step-"))
    return out


def case_train(rt, spec):
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=spec.get("async", False))
    return fit(rt, trainer_for(rt, spec, (), ckpt))


def case_refuse(rt, spec):
    """A resume whose data differs (on the processes in more_data_on): refused on every process, the model as
    it was built."""
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=False)
    trainer = trainer_for(rt, {**spec, "resume": True}, (), ckpt)
    before = checksum(trainer.module)
    out = fit(rt, trainer)
    out["unchanged"] = checksum(trainer.module) == before
    return out


def case_prune(rt, spec):
    """Process 0's first prune fails after a good commit (keep=1: the save of step 4 removes step 2)."""
    ckpt = CheckpointManager(spec["ckpt"], keep=1, rt=rt, async_save=True)
    if rt.is_master:
        prune = ckpt._prune

        def failing(*a, **k):
            ckpt._prune = prune
            raise OSError(f"cannot delete in {spec['ckpt']} (simulated)")

        ckpt._prune = failing
    out = fit(rt, trainer_for(rt, spec, (), ckpt))
    out["saved"] = sorted(n for n in os.listdir(spec["ckpt"]) if n.startswith("step-"))
    return out


def case_stage_fail(rt, spec):
    """The CPU copy of process 1's shards fails (an out-of-memory host, say) at the first background save."""
    from labkit.checkpoint.staging import CpuMirror

    copy = CpuMirror.stage
    if rt.ordinal == 1:

        def failing(self, state):
            raise MemoryError("staging failed on this host (simulated)")

        CpuMirror.stage = failing
    try:
        ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=True)
        out = fit(rt, trainer_for(rt, spec, (), ckpt))
    finally:
        CpuMirror.stage = copy
    out["saved"] = (
        sorted(n for n in os.listdir(spec["ckpt"]) if n.startswith("step-")) if os.path.isdir(spec["ckpt"]) else []
    )
    return out


def case_reads(rt, spec):
    """Process 1's view of the store is stale or ahead (an eventually consistent listing): its own reads would say a
    newer step 999 exists. latest() and the older-step rule must take process 0's."""
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=False)
    if rt.ordinal == 1:
        fmt = ckpt.formats["sharded"]
        fmt.record = lambda: {"step": 999, "metrics": {}}
        ckpt._entries = lambda: [(999, fmt, True)]
    latest = ckpt.latest()
    out = fit(rt, trainer_for(rt, spec, (), ckpt))
    out["latest"] = latest
    return out


def case_settings(rt, spec):
    """The learning rate (lr: one per process) and the data (a_step_more_on: a batch more there) differ: the
    Trainer's construction raises on every process."""
    try:
        trainer_for(rt, spec)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {}


class AtEval:
    """on_eval of the first epoch, on the processes named: a save asked (save_on), or SIGTERM sent to itself
    (term_on)."""

    def __init__(self, rt, spec):
        self.rt, self.save_on, self.term_on = rt, spec.get("save_on", []), spec.get("term_on", [])

    def on_eval(self, trainer, out):
        if trainer.epoch == 0 and self.rt.ordinal in self.save_on:
            trainer.request_checkpoint()
        if trainer.epoch == 0 and self.rt.ordinal in self.term_on:
            os.kill(os.getpid(), signal.SIGTERM)


def case_boundary(rt, spec):
    """Two epochs of `steps`, evaluated after each; at the first evaluation a save asked or SIGTERM on one process."""
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=False)
    trainer = trainer_for(rt, spec, [AtEval(rt, spec)], ckpt)
    try:
        out = fit(rt, trainer)
    except KeyboardInterrupt as e:  # Preempted: fit() waited for the save, then raised it
        ckpt.close()
        out = {"error": f"{type(e).__name__}: {e}", "step": trainer.step}
    out["saved"] = sorted(n for n in os.listdir(spec["ckpt"]) if n.startswith("step-"))
    out["position"] = [trainer.epoch, trainer.batch_in_epoch]
    return out


def case_eval_first(rt, spec):
    """An evaluation before any training step (no spare batch) where process 1 has no evaluation batch."""
    trainer = trainer_for(rt, spec)
    g = torch.Generator().manual_seed(2)
    text = torch.randint(0, 8, (1, 16, 17), generator=g)
    trainer.eval_loader = trainer._wrap(Rows(text[: 1 - rt.ordinal], rt.ordinal, rt.world_size))
    try:
        trainer.evaluate()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {}


class StateInOnLog:
    """A callback that calls trainer.state_dict() in on_log (process 0 only) and keeps what it raised."""

    said = None

    def on_log(self, trainer, rec):
        if rec["step"] == 1:
            try:
                trainer.state_dict()
            except RuntimeError as e:
                self.said = str(e)


def case_state_dict(rt, spec):
    cb = StateInOnLog()
    trainer = trainer_for(rt, spec, [cb])
    out = fit(rt, trainer)
    state = trainer.state_dict()  # the documented path: every process, at the same point
    out.update(said=cb.said, keys=sorted(k for k in state if not k.startswith("rng")))
    return out


def case_timeouts(rt, spec):
    """The timeouts of the side groups a run makes: the step vote's, the lockstep's, the checkpoint's."""
    ckpt = CheckpointManager(spec["ckpt"], keep=3, rt=rt, async_save=False)
    trainer = trainer_for(rt, spec, (), ckpt)
    out = fit(rt, trainer)
    groups = {"vote": trainer.vote._group, "checkpoint": ckpt._pg}
    trainer.eval_loader = trainer._wrap(trainer.train_loader.loader)
    trainer.evaluate()
    groups["lockstep"] = trainer.plan._cpu
    out["timeouts"] = {
        k: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for k, g in groups.items()
    }
    return out


def case_prep_wait(rt, spec):
    """labkit.torchrun.wait_for_all: process 1 waits 1 s for process 0, which arrives only once process 1 has timed
    out (told through the store, so no clock decides the order); then both pass a second wait of the same tag."""
    from labkit.torchrun import wait_for_all

    store = dist.distributed_c10d._get_default_store()
    out = {}
    if rt.ordinal == 1:
        try:
            wait_for_all(rt, "prep", "waiting for process 0's data", timeout_s=1)
        except TimeoutError as e:
            out["error"] = str(e)
        store.set("test/timed-out", b"1")
    else:
        store.wait(["test/timed-out"])
        wait_for_all(rt, "prep", "waiting for process 0's data", timeout_s=60)
    wait_for_all(rt, "prep", "the second wait", timeout_s=60)
    out["passed"] = True
    return out


CASES = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("case_")}


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    rt = labkit.setup("cpu")  # under torchrun: one gloo process per rank
    report = {}
    for spec in job["runs"]:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                mine = CASES[spec["case"]](rt, spec)
            except Exception as e:
                mine = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        mine["warnings"] = [str(w.message) for w in said if "step-" in str(w.message)]
        every = [None] * rt.world_size
        dist.all_gather_object(every, mine)
        report[spec["name"]] = every
        if rt.is_master:
            with open(job["out"], "w") as f:
                json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
