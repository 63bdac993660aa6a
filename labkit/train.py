"""Notebooks 01 and 02 as a script: the same parameters, the same recipes, on one chip or many.

    python -m labkit.train gpt --fast --max-steps 50              # one process: TPU, GPU, XLA:CPU or CPU
    python -m labkit.train resnet --epochs 8 --batch-size 128     # a TPU VM: SPMD over every local chip
    torchrun --nproc_per_node=4 -m labkit.train gpt ...           # GPUs (nccl) or CPU ranks (gloo), DDP
    torchrun --nproc_per_node=4 -m labkit.train gpt --parallel fsdp2   # the same, each weight sharded (FSDP2)
    gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="python -m labkit.train resnet ..."

Flags are the notebooks' `Params` fields (`--batch-size` is `batch_size`, per chip), read in the order
notebooks use: literal defaults, the FAST overlay (`--fast` or LABKIT_FAST=1), LABKIT_<NAME> environment
variables, then the flags given. A test keeps GPTParams/ResNetParams equal to the notebooks' cells.

How the work is split:
- one host, several XLA devices (a TPU v5e-8, CPU_NUM_DEVICES=4): SPMD (`--spmd auto`), one process
  loads batch_size x chips samples per step and XLA shards them over the devices;
- a TPU pod slice: the same command on every host (`--worker=all`); each host is one process
  (xr.process_index / process_count become rt.ordinal / rt.world_size) and reads its own shards;
- torchrun: one process per GPU or CPU rank, DistributedDataParallel averaging gradients (--parallel replicate),
  or FSDP2 sharding weights, gradients and AdamW state over them (--parallel fsdp2; auto: by what fits).
The global batch is batch_size x chips x processes. Only process 0 prints, logs and writes checkpoints.
The last line on process 0 is machine-readable:
    FINAL loss=<final validation loss> train_loss=<last interval, process 0> steps=N samples=M world=W chips=C
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing

from labkit.config import PARALLEL, check_number, fast_mode, from_env, parse_bool
from labkit.interrupts import sigterm_raises
from labkit.optim import scaled_lr


@dataclasses.dataclass
class ResNetParams:
    """Notebook 01's parameters (same names, defaults and FAST overlay)."""

    source: str = "auto"
    data_dir: str = "data/shards"
    local_gcs: bool = False
    samples_per_shard: int = 2500
    upsample: int = 1
    batch_size: int = 128
    accum_steps: int = 1  # micro-batches per optimizer step: the global batch is batch_size x chips x this
    spmd: str = "auto"
    epochs: int = 8
    max_steps: int = 0
    optimizer: str = "sgd"
    lr: float = 0.1
    cifar_stem: bool = True
    precision: str = "auto"  # labkit.precision.choose: auto | bf16 | fp16 | fp32 | true | false
    log_every: int = 20
    num_workers: int = 2
    checkpoint_dir: str = "checkpoints/resnet50"
    gcp_project: str = ""
    checkpoint_every: int = 0
    resume_steps: int = 20
    seed: int = 0
    FAST: typing.ClassVar[dict] = {
        "source": "digits",
        "local_gcs": True,
        "samples_per_shard": 200,
        "batch_size": 32,
        "epochs": 2,
        "optimizer": "adamw",
        "lr": 1e-3,
        "cifar_stem": False,
        "log_every": 4,
        "num_workers": 0,
        "checkpoint_every": 20,
        "resume_steps": 8,
    }


@dataclasses.dataclass
class GPTParams:
    """Notebook 02's parameters (same names, defaults and FAST overlay)."""

    source: str = "auto"
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.1
    batch_size: int = 64
    spmd: str = "auto"
    max_steps: int = 5000
    evals: int = 10
    eval_batches: int = 20
    lr: float = 1e-3
    weight_decay: float = 0.1
    precision: str = "auto"  # labkit.precision.choose: auto | bf16 | fp16 | fp32 | true | false
    log_every: int = 100
    gen_tokens: int = 600
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    save_to: str = ""
    gcp_project: str = ""
    FAST: typing.ClassVar[dict] = {
        "source": "offline",
        "block_size": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 64,
        "dropout": 0.0,
        "batch_size": 16,
        "max_steps": 400,
        "evals": 2,
        "eval_batches": 4,
        "lr": 1e-2,
        "log_every": 40,
        "gen_tokens": 150,
    }


RECIPES = {"resnet": ResNetParams, "gpt": GPTParams}


# What each number and word accepts, checked while argparse reads the flag (its one-line error naming the flag,
# exit 2, before any set-up) and again for LABKIT_<NAME> values: {field: check_number's bounds}, per recipe where
# they differ (a GPT needs steps for its schedule; ResNet's max_steps 0 means no cap).
_COUNTS = ("samples_per_shard", "upsample", "batch_size", "accum_steps", "epochs", "log_every", "resume_steps")
LIMITS = {
    **{n: {"low": 1, "integer": True} for n in _COUNTS + ("block_size", "n_layer", "n_head", "n_embd", "evals")},
    **{n: {"integer": True} for n in ("max_steps", "num_workers", "checkpoint_every", "seed", "gen_tokens", "top_k")},
    "eval_batches": {"low": 1, "integer": True},
    "lr": {"above": True},
    "weight_decay": {},
    "dropout": {"high": 1.0},
    "temperature": {"above": True},
}
RECIPE_LIMITS = {"gpt": {"max_steps": {"low": 1, "integer": True}}}


def _choice(name: str, value: str, recipe: str) -> None:
    """The words a flag accepts, checked by the module that reads them (ValueError naming the value)."""
    if name == "optimizer" and value not in ("sgd", "adamw"):
        raise ValueError(f"{value!r} is not 'sgd' or 'adamw'")
    if name == "precision":
        from labkit.precision import parse_mode

        parse_mode(value)
    if name == "spmd":
        from labkit.device import parse_spmd

        parse_spmd(value)
    if name == "source" and recipe == "resnet":
        from data_tools.sources import SOURCES

        if value not in ("auto", *SOURCES):
            raise ValueError(f"{value!r} is not one of auto, {', '.join(SOURCES)}")


def check_value(recipe: str, name: str, value, label: str):
    """`value` if the recipe's field `name` accepts it, else ValueError naming `label` (the flag or variable)."""
    bounds = RECIPE_LIMITS.get(recipe, {}).get(name, LIMITS.get(name))
    if bounds is not None:
        check_number(label, value, **bounds)
    elif isinstance(value, str):
        try:
            _choice(name, value, recipe)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
    return value


def _flag_type(name: str, typ, recipe: str = ""):
    flag = f"--{name.replace('_', '-')}"
    if typ is bool:
        return lambda raw: parse_bool(raw, flag)

    def read(raw: str):
        try:
            value = typ(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {'an integer' if typ is int else 'a number'}") from None
        try:  # the message without the flag's name: argparse puts "argument --flag: " before it
            return check_value(recipe, name, value, "")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).lstrip("=: ")) from None

    read.__name__ = typ.__name__  # argparse names the type in its own messages
    return read


def parser() -> argparse.ArgumentParser:
    """One sub-command per recipe; its flags are generated from the Params fields (default None: not given)."""
    from labkit.device import BACKENDS

    top = argparse.ArgumentParser(prog="python -m labkit.train", description=__doc__.split("\n")[0])
    subs = top.add_subparsers(dest="recipe", required=True)
    for name, cls in RECIPES.items():
        sub = subs.add_parser(name, help=cls.__doc__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            sub.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=_flag_type(f.name, hints[f.name], name),
                default=None,
                help=f"default {f.default!r}" + (f", fast {cls.FAST[f.name]!r}" if f.name in cls.FAST else ""),
            )
        sub.add_argument("--fast", action="store_true", help="the CI-sized run (as LABKIT_FAST=1)")
        sub.add_argument(
            "--backend", default=None, choices=BACKENDS, help="tpu | cuda | xla-cpu | cpu (default: detect)"
        )
        sub.add_argument(
            "--parallel",
            default=None,
            choices=PARALLEL,
            help="under torchrun: replicate (DDP) | fsdp2 (fully_shard per block) | auto (by what fits; default "
            "$LABKIT_PARALLEL, else auto); TrainConfig.parallel",
        )
    return top


def params_from(args) -> object:
    cls = RECIPES[args.recipe]
    if args.fast:
        os.environ["LABKIT_FAST"] = "1"  # labkit reads it elsewhere too (one meaning of "fast" per process)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}
    P = from_env(cls, **given)
    for f in dataclasses.fields(cls):  # the flags were checked as they were read; the environment's values here
        if f.name not in given:
            check_value(args.recipe, f.name, getattr(P, f.name), f"LABKIT_{f.name.upper()}")
    return P


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


def _parallel(choice) -> str:
    """--parallel, else LABKIT_PARALLEL (TrainConfig.parallel's variable), else "auto"."""
    return choice or os.environ.get("LABKIT_PARALLEL") or "auto"


def run_resnet(P: ResNetParams, backend=None, parallel=None) -> dict:
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
        return _train_resnet(P, rt, plan, prec, data, ckpt_root, parallel)
    finally:
        if server is not None:
            server.close()


def _train_resnet(P: ResNetParams, rt, plan, prec, data: str, ckpt_root: str, parallel=None) -> dict:
    import labkit
    from data_tools import load_manifest
    from labkit.checkpoint import CheckpointManager
    from labkit.lessons import recipes

    source = P.source if P.source != "auto" else ("cifar10" if labkit.envsetup.online() else "digits")
    if rt.is_master:  # one writer; the others wait, then find the manifests
        recipes.image_shards(source, data, P.upsample, P.samples_per_shard)
    rt.rendezvous("labkit-train-shards")
    manifests = recipes.image_shards(source, data, P.upsample, P.samples_per_shard)
    classes = load_manifest(manifests["train"])["class_names"]
    train, val = recipes.image_loaders(manifests, plan, rt, num_workers=P.num_workers, seed=P.seed)
    # lr was set for one chip's batch: scaled to the global one as notebook 01 does (SGD linear, AdamW square root)
    global_batch = plan.global_batch * P.accum_steps
    lr = scaled_lr(P.lr, P.batch_size, global_batch, "linear" if P.optimizer == "sgd" else "sqrt")
    model, optimizer = recipes.build_resnet(len(classes), P.cifar_stem, P.optimizer, lr, P.seed, rt)
    cfg = labkit.TrainConfig(
        epochs=P.epochs,
        max_steps=P.max_steps,
        log_every=P.log_every,
        accum_steps=P.accum_steps,
        checkpoint_every=P.checkpoint_every or len(train) // P.accum_steps,
        parallel=_parallel(parallel),
    )
    total = min(cfg.epochs * (len(train) // P.accum_steps), cfg.max_steps or 10**12)
    ckpt = CheckpointManager(f"{ckpt_root}/{time.strftime('run-%Y%m%d-%H%M%S')}", keep=2, rt=rt)
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


def run_gpt(P: GPTParams, backend=None, parallel=None) -> dict:
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
    model, optimizer, scheduler = recipes.build_gpt(gcfg, P.lr, P.weight_decay, P.max_steps, P.seed, rt)
    cfg = labkit.TrainConfig(
        epochs=P.evals,
        max_steps=P.max_steps,
        clip_norm=1.0,
        log_every=P.log_every,
        eval_every=1,
        parallel=_parallel(parallel),
    )
    ckpt = None
    if P.save_to:
        if gcs.sign_in(P.save_to, project=P.gcp_project or None):
            gcs.check_access(P.save_to, write=True)
        ckpt = CheckpointManager(P.save_to, keep=1, rt=rt)
    trainer = LMTrainer(
        model, optimizer, rt, cfg, train, val, scheduler=scheduler, callbacks=[ConsoleLog()], precision=prec
    )
    return _finish(trainer, plan, ckpt, extra={"source": name})


def _finish(trainer, plan, ckpt, extra: dict) -> dict:
    """Train, evaluate once more if the last step was not evaluated, save, and print the FINAL line."""
    rt = trainer.rt
    rt.master_print(f"[labkit.train] parallel: {trainer.plan.describe()}")
    history = trainer.fit()
    evals = trainer.eval_history
    final = evals[-1] if evals and evals[-1]["step"] == trainer.step else trainer.evaluate()
    if ckpt is not None:
        ckpt.save(trainer.step, trainer.state_dict(), metrics=final, force=True)
        ckpt.wait()
        rt.master_print(f"[labkit.train] saved step {trainer.step} to {ckpt.root}")
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
    top = parser()
    args = top.parse_args(argv)
    try:
        P = params_from(args)
    except ValueError as e:  # a LABKIT_<NAME> value: the same one-line error and exit 2 as a flag's
        top.error(str(e))
    if fast_mode() and os.environ.get("RANK", "0") == "0":
        print(f"[labkit.train] {args.recipe} (fast): {P}", flush=True)
    run = run_resnet if args.recipe == "resnet" else run_gpt
    with sigterm_raises():  # SIGTERM as an exception: the finally blocks stop what the run started
        result = run(P, backend=args.backend, parallel=args.parallel)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
