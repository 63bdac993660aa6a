"""Notebooks 01 and 02 as a script: the same parameters, the same recipes, on one chip or many.

    python -m labkit.train gpt --fast --max-steps 50              # one process: TPU, GPU, XLA:CPU or CPU
    python -m labkit.train resnet --epochs 8 --batch-size 128     # a TPU VM: SPMD over every local chip
    torchrun --nproc_per_node=4 -m labkit.train gpt ...           # GPUs (nccl) or CPU ranks (gloo), DDP
    torchrun --nproc_per_node=4 -m labkit.train gpt --parallel fsdp2   # the same, each weight sharded (FSDP2)
    torchrun --nnodes=2 --nproc_per_node=8 ... -m labkit.train resnet --parallel hsdp --accum-steps 4 \
        --fsdp-accumulate sharded                                   # two hosts: sharded within, replicated across
    gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="python -m labkit.train resnet ..."

Flags are the notebooks' `Params` fields (`--batch-size` is `batch_size`, per chip), read in the order
notebooks use: literal defaults, the FAST overlay (`--fast` or LABKIT_FAST=1), LABKIT_<NAME> environment
variables, then the flags given. A test keeps GPTParams/ResNetParams equal to the notebooks' cells.

How the work is split:
- one host, several XLA devices (a TPU v5e-8, CPU_NUM_DEVICES=4): SPMD (`--spmd auto`), one process
  loads batch_size x chips samples per step and XLA shards them over the devices;
- a TPU pod slice: the same command on every host (`--worker=all`); each host is one process
  (xr.process_index / process_count become rt.ordinal / rt.world_size) and reads its own shards;
- torchrun: one process per GPU or CPU rank (labkit.parallel says how, and counts what each plan issues):
  - --parallel replicate: DistributedDataParallel, a whole copy per process, gradients all-reduced;
  - --parallel fsdp2: FSDP2 shards weights, gradients and AdamW state over the processes, one unit per transformer
    block or residual block (a ResNet's BatchNorms one float32 unit per block under bf16), then the root. A step
    all-gathers the root once, each block in forward and all but the last block again in backward (2L all-gathers
    for L blocks), and reduce-scatters each unit's gradients;
  - --parallel hsdp: the same within each host, replicated across hosts (torchrun --nnodes): the all-gathers and
    reduce-scatters stay inside a host, one all-reduce of each gradient shard a step crosses between hosts;
  - --parallel auto: replicate where a whole copy fits half a device, else hsdp (several hosts) or fsdp2;
  - --fsdp-accumulate (resnet, with --accum-steps > 1): gathered (k = 1's collectives, a whole copy's memory) or
    sharded (k times the collectives, shards only; across hosts still once a step); auto by what fits.
The global batch is batch_size x chips x processes (x accum_steps). Only process 0 prints and logs. Checkpoints:
under replicate process 0 writes one file; under fsdp2 and hsdp every process writes its own shards (DCP), process 0
commits once all are stored, and a run on another number of processes resumes them.
The last line on process 0 is machine-readable:
    FINAL loss=<final validation loss> train_loss=<last interval, process 0> steps=N samples=M world=W chips=C
"""

from __future__ import annotations

import os
import sys
import time

from labkit.config import fast_mode
from labkit.interrupts import Preempted, sigterm_deferred, sigterm_raises
from labkit.optim import scaled_lr

# the recipes' parameters and the flags' checks (labkit.train.parser() is the script's command line)
from labkit.train_flags import RECIPES, GPTParams, ResNetParams, check_value, params_from, parser  # noqa: F401


class ConsoleLog:
    """Trainer callback: one line per log interval (the Trainer calls on_log on process 0 only)."""

    def on_log(self, trainer, rec: dict) -> None:
        print(
            f"step {rec['step']:6d}  epoch {rec['epoch']}  loss {rec['loss']:.4f}  "
            f"{rec['examples_per_s']:.1f} examples/s  lr {rec['lr']:.2e}",
            flush=True,
        )

    def on_eval(self, trainer, rec: dict) -> None:
        if trainer.rt.is_master:
            print(
                f"eval at step {rec['step']}: val_loss {rec['val_loss']:.4f}  val_acc {rec['val_acc']:.2%}", flush=True
            )


def _runtime(P, backend):
    import labkit

    rt = labkit.setup(backend, spmd=P.spmd)
    prec = labkit.precision.choose(rt, P.precision)
    plan = labkit.spmd.mesh.batch_plan(rt, P.batch_size)
    rt.master_print(f"[labkit.train] {rt}; precision {prec}\n[labkit.train] {plan.describe()}")
    return rt, prec, plan


class SettingError(ValueError):
    """A setting of the run (a flag, a LABKIT_ variable) it cannot use: one line and exit 2 (main)."""


def _parallel(choice) -> str:
    """--parallel, else LABKIT_PARALLEL (TrainConfig.parallel's variable), else "auto"; a name no plan has is refused
    naming the variable (the flag's choices are argparse's)."""
    from labkit.parallel import check_setting

    if choice:
        return choice
    return check_setting(os.environ.get("LABKIT_PARALLEL") or "auto", "LABKIT_PARALLEL")


def _fsdp_accumulate(choice) -> str:
    """--fsdp-accumulate, else LABKIT_FSDP_ACCUMULATE (TrainConfig.fsdp_accumulate's variable), else "auto"; a mode
    FullyShard does not have is refused naming the variable (the flag's choices are argparse's)."""
    from labkit.config import ACCUMULATE

    value = choice or os.environ.get("LABKIT_FSDP_ACCUMULATE") or "auto"
    if value not in ACCUMULATE:
        raise SettingError(f"LABKIT_FSDP_ACCUMULATE={value!r}: expected one of {', '.join(ACCUMULATE)}")
    return value


def resnet_config(P, batches: int, parallel=None, fsdp_accumulate=None, resume=None, save_every=None):
    """The resnet recipe's TrainConfig: P's fields, `batches` per epoch from the train loader, the command line's
    plan (--parallel) and accumulation mode (--fsdp-accumulate), or their variables."""
    import labkit

    return labkit.TrainConfig(
        epochs=P.epochs,
        max_steps=P.max_steps,
        log_every=P.log_every,
        accum_steps=P.accum_steps,
        checkpoint_every=save_every or P.checkpoint_every or batches // P.accum_steps,
        parallel=_parallel(parallel),
        fsdp_accumulate=_fsdp_accumulate(fsdp_accumulate),
        resume=resume is not None,
    )


def run_folder(rt, root: str, resume: str | None) -> str:
    """The run's checkpoint folder, decided on process 0 and sent to the others (each process naming it from its own
    clock would split one run's shards over several folders). resume=None: a new `run-YYYYmmdd-HHMMSS` under root;
    "latest": the newest run-* folder under root; else that folder (a path or gs:// URL)."""
    name = None
    if rt.is_master:
        if resume is None:
            name = f"{root}/{time.strftime('run-%Y%m%d-%H%M%S')}"
        elif resume == "latest":
            from labkit.cloud import open_store

            runs = sorted({n.split("/")[0] for n in open_store(root).list("run-")})
            name = f"{root}/{runs[-1]}" if runs else f"no run-* folder under {root} to resume"
        else:
            name = resume
    name = rt.broadcast_object(name, "labkit-train-run-folder")
    if name.startswith("no run-* folder"):
        raise SettingError(f"--resume: {name}; give the run folder (--resume FOLDER) or start without --resume")
    rt.master_print(f"[labkit.train] checkpoints: {name}" + (" (resuming its newest committed step)" if resume else ""))
    return name


def run_resnet(
    P: ResNetParams, backend=None, parallel=None, resume=None, save_every=None, fsdp_accumulate=None, meta_init=False
) -> dict:
    from labkit.cloud import gcs
    from labkit.lessons import recipes

    rt, prec, plan = _runtime(P, backend)
    server = None
    data, ckpt_root = P.data_dir, P.checkpoint_dir
    if P.local_gcs and rt.world_size > 1:
        raise ValueError(
            f"local_gcs=True starts a GCS-API server inside each of the {rt.world_size} processes, which would "
            "not share their data: pass --local-gcs false and a --data-dir/--checkpoint-dir every process can "
            "reach (a gs:// bucket, or a local folder when all processes run on one machine)"
        )
    if P.local_gcs:  # a GCS-API server on 127.0.0.1: the gs:// code path without an account
        server, data = recipes.local_gcs_root(P.data_dir)
        ckpt_root = "gs://labkit-local/" + P.checkpoint_dir.strip("/").replace("/", "-")
    else:
        gcs.sign_in(P.data_dir, P.checkpoint_dir, project=P.gcp_project or None)
    try:  # whatever fails from here on, the server ends with the run
        flags = dict(parallel=parallel, resume=resume, save_every=save_every, fsdp_accumulate=fsdp_accumulate)
        return _train_resnet(P, rt, plan, prec, data=data, ckpt_root=ckpt_root, meta_init=meta_init, **flags)
    finally:
        if server is not None:
            server.close()


def _train_resnet(
    P, rt, plan, prec, *, data: str, ckpt_root: str, parallel, resume, save_every, fsdp_accumulate, meta_init
) -> dict:
    """run_resnet's run, once its data and checkpoint roots are known: the params, the runtime's three decisions,
    then by name where the data and checkpoints go and the command line's overrides."""
    import labkit
    from data_tools import load_manifest
    from labkit import torchrun
    from labkit.checkpoint import CheckpointManager
    from labkit.lessons import recipes

    source = P.source if P.source != "auto" else ("cifar10" if labkit.envsetup.online() else "digits")
    # one writer at a time: process 0 first (a shared folder or bucket: the others find its shards), then the first
    # process of every other host (a host-local folder: written once per host, not by each of its processes)
    # (the waits go through torchrun's store, an hour at most: not an NCCL barrier under its 600 s watchdog)
    if rt.is_master:
        recipes.image_shards(source, data, P.upsample, P.samples_per_shard)
    torchrun.wait_for_all(rt, "labkit-train-shards", f"waiting for process 0 to write the shards under {data}")
    if rt.local_ordinal == 0 and not rt.is_master:
        recipes.image_shards(source, data, P.upsample, P.samples_per_shard)
    torchrun.wait_for_all(rt, "labkit-train-shards-hosts", f"waiting for each host's shards under {data}")
    manifests = recipes.image_shards(source, data, P.upsample, P.samples_per_shard)
    classes = load_manifest(manifests["train"])["class_names"]
    train, val = recipes.image_loaders(manifests, plan, rt, num_workers=P.num_workers, seed=P.seed)
    # lr was set for one chip's batch: scaled to the global one as notebook 01 does (SGD linear, AdamW square root)
    global_batch = plan.global_batch * P.accum_steps
    lr = scaled_lr(P.lr, P.batch_size, global_batch, "linear" if P.optimizer == "sgd" else "sqrt")
    model, optimizer = recipes.build_resnet(len(classes), P.cifar_stem, P.optimizer, lr, P.seed, rt, meta=meta_init)
    cfg = resnet_config(P, len(train), parallel, fsdp_accumulate, resume, save_every)
    total = min(cfg.epochs * (len(train) // P.accum_steps), cfg.max_steps or 10**12)
    ckpt = CheckpointManager(run_folder(rt, ckpt_root, resume), keep=2, rt=rt)
    trainer = labkit.Trainer(
        model,
        optimizer,
        rt,
        cfg,
        train,
        val,
        scheduler=recipes.resnet_schedule(optimizer, total),
        callbacks=[ConsoleLog()],
        checkpoint=ckpt,
        precision=prec,
    )
    return _finish(trainer, plan, ckpt, extra={"source": source})


def run_gpt(P: GPTParams, backend=None, parallel=None, resume=None, save_every=None, meta_init=False) -> dict:
    import labkit
    from data_tools.text import split
    from labkit.checkpoint import CheckpointManager
    from labkit.cloud import gcs
    from labkit.lessons import recipes
    from labkit.lm import LMTrainer
    from labkit.models.gpt import GPTConfig

    rt, prec, plan = _runtime(P, backend)
    name, data = recipes.load_text(P.source)
    train_data, val_data = split(data)
    train, val = recipes.text_batches(
        train_data,
        val_data,
        plan,
        rt,
        block_size=P.block_size,
        steps_per_eval=max(1, P.max_steps // P.evals),
        eval_batches=P.eval_batches,
        seed=P.seed,
        name=name,
    )
    gcfg = GPTConfig(block_size=P.block_size, n_layer=P.n_layer, n_head=P.n_head, n_embd=P.n_embd, dropout=P.dropout)
    model, optimizer, scheduler = recipes.build_gpt(gcfg, P.lr, P.weight_decay, P.max_steps, P.seed, rt, meta=meta_init)
    if (resume is not None or save_every) and not P.save_to:
        raise SettingError("--resume and --save-every need --save-to FOLDER (the gpt recipe's checkpoint folder)")
    if resume not in (None, "latest", P.save_to):
        raise SettingError(f"--resume {resume}: the gpt recipe resumes from its --save-to folder ({P.save_to!r})")
    cfg = labkit.TrainConfig(
        epochs=P.evals,
        max_steps=P.max_steps,
        clip_norm=1.0,
        log_every=P.log_every,
        eval_every=1,
        parallel=_parallel(parallel),
        checkpoint_every=save_every or 0,
        resume=resume is not None,
    )
    ckpt = None
    if P.save_to:
        if gcs.sign_in(P.save_to, project=P.gcp_project or None):
            gcs.check_access(P.save_to, write=True)
        ckpt = CheckpointManager(P.save_to, keep=1, rt=rt)
    trainer = LMTrainer(
        model,
        optimizer,
        rt,
        cfg,
        train,
        val,
        scheduler=scheduler,
        callbacks=[ConsoleLog()],
        precision=prec,
        checkpoint=ckpt if save_every or resume is not None else None,  # else only the final save, in _finish
    )
    return _finish(trainer, plan, ckpt, extra={"source": name})


def _finish(trainer, plan, ckpt, extra: dict) -> dict:
    """Train, evaluate once more if the last step was not evaluated, save, and print the FINAL line. After fit()
    (whose steps vote on SIGTERM), a SIGTERM waits until the final evaluation and save are done on every process:
    raised on one process in the middle of them, it would leave the others in their collectives."""
    rt = trainer.rt
    rt.master_print(f"[labkit.train] parallel: {trainer.plan.describe()}")
    history = trainer.fit()
    with sigterm_deferred() as got:
        evals = trainer.eval_history
        final = evals[-1] if evals and evals[-1]["step"] == trainer.step else trainer.evaluate()
        if ckpt is not None:
            ckpt.save(trainer.step, trainer.state_dict(), metrics=final, force=True)
            ckpt.wait()
            rt.master_print(f"[labkit.train] saved step {trainer.step} to {ckpt.root}")
        rt.rendezvous("labkit-train-saved")
    if got:
        raise Preempted(f"SIGTERM after the last step: the final evaluation and the save of step {trainer.step} ended")
    result = {
        "loss": final["val_loss"],
        "train_loss": history[-1]["loss"] if history else float("nan"),
        "steps": trainer.step,
        "samples": trainer.step * plan.global_batch,
        "world": rt.world_size,
        "chips": plan.total_chips,
        **extra,
    }
    rt.master_print(
        "FINAL " + " ".join(f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
    )
    rt.rendezvous("labkit-train-end")
    return result


def main(argv=None) -> dict:
    from labkit.parallel import PlanError

    top = parser()
    args = top.parse_args(argv)
    try:
        P = params_from(args)
    except ValueError as e:  # a LABKIT_<NAME> value: the same one-line error and exit 2 as a flag's
        top.error(str(e))
    if fast_mode() and os.environ.get("RANK", "0") == "0":
        print(f"[labkit.train] {args.recipe} (fast): {P}", flush=True)
    run = run_resnet if args.recipe == "resnet" else run_gpt
    extra = {"fsdp_accumulate": args.fsdp_accumulate} if args.recipe == "resnet" else {}  # gpt does not accumulate
    try:
        with sigterm_raises():  # SIGTERM as an exception: the finally blocks stop what the run started
            kw = {"parallel": args.parallel, "resume": args.resume, "save_every": args.save_every, **extra}
            return run(P, backend=args.backend, meta_init=args.meta_init, **kw)
    except (PlanError, SettingError) as e:  # a setting this run cannot use: one line naming it, exit 2
        top.error(str(e))
    finally:  # a clean end, an error or SIGTERM alike: the other processes are not left waiting for this one
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Preempted as e:  # what was started is saved and stopped: one line, no traceback, 128 + SIGTERM's 15
        print(f"[labkit.train] Preempted: {e}", file=sys.stderr, flush=True)
        sys.exit(143)
