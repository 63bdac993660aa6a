"""The command line of `python -m labkit.train`: notebooks 01's and 02's Params as dataclasses (a test keeps them
equal to the notebooks' cells), and what each flag accepts, checked while argparse reads it (its one-line error
naming the flag, exit 2, before any set-up) and again for LABKIT_<NAME> values.

    args = parser().parse_args(["gpt", "--fast", "--max-steps", "50"]); P = params_from(args)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from labkit.config import ACCUMULATE, PARALLEL, check_number, from_env, parse_bool


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
        "epochs": 1,
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
_COUNT = {"low": 1, "integer": True}
_BOUNDS = (  # (bounds, the fields that have them)
    (_COUNT, ("samples_per_shard", "upsample", "batch_size", "accum_steps", "epochs", "log_every", "resume_steps",
              "block_size", "n_layer", "n_head", "n_embd", "evals", "eval_batches", "save_every")),
    ({"integer": True}, ("max_steps", "num_workers", "checkpoint_every", "seed", "gen_tokens", "top_k")),
    ({"above": True}, ("lr", "temperature")),
    ({"high": 1.0}, ("dropout",)),
    ({}, ("weight_decay",)),
)  # fmt: skip
LIMITS = {name: dict(bounds) for bounds, names in _BOUNDS for name in names}
RECIPE_LIMITS = {"gpt": {"max_steps": dict(_COUNT)}}


# The words a flag accepts, each checked by the module that reads them (imported only when a word is checked): a
# ValueError naming the value. {field: its check}, per recipe where they differ (only ResNet's source is a list).
def _optimizer(value: str) -> None:
    if value not in ("sgd", "adamw"):
        raise ValueError(f"{value!r} is not 'sgd' or 'adamw'")


def _precision(value: str) -> None:
    from labkit.precision import parse_mode

    parse_mode(value)


def _spmd(value: str) -> None:
    from labkit.device import parse_spmd

    parse_spmd(value)


def _resnet_source(value: str) -> None:
    from data_tools.sources import SOURCES

    if value not in ("auto", *SOURCES):
        raise ValueError(f"{value!r} is not one of auto, {', '.join(SOURCES)}")


CHOICES = {"optimizer": _optimizer, "precision": _precision, "spmd": _spmd}
RECIPE_CHOICES = {"resnet": {"source": _resnet_source}}


def check_value(recipe: str, name: str, value, label: str):
    """`value` if the recipe's field `name` accepts it, else ValueError naming `label` (the flag or variable)."""
    bounds = RECIPE_LIMITS.get(recipe, {}).get(name, LIMITS.get(name))
    if bounds is not None:
        check_number(label, value, **bounds)
    elif isinstance(value, str) and (check := RECIPE_CHOICES.get(recipe, {}).get(name, CHOICES.get(name))):
        try:
            check(value)
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

    top = argparse.ArgumentParser(
        prog="python -m labkit.train",
        description="Notebooks 01 and 02 as a script: the same parameters, the same recipes, on one chip or many.",
    )
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
            "--backend",
            default=None,
            choices=BACKENDS,
            help="tpu (torch_xla) | torch-tpu (TorchTPU) | cuda | xla-cpu | cpu (default: detect)",
        )
        sub.add_argument(
            "--parallel",
            default=None,
            choices=PARALLEL,
            help="under torchrun: replicate (DDP: a whole copy per process, gradients all-reduced) | fsdp2 "
            "(fully_shard per transformer or residual block, then the root: each step all-gathers the root once, "
            "every block in forward and all but the last again in backward, and reduce-scatters its gradients) | hsdp (fsdp2 within "
            "each host, replicated across hosts: one all-reduce of each gradient shard per step crosses them) | auto "
            "(by what fits; default $LABKIT_PARALLEL, else auto); TrainConfig.parallel",
        )
        if "accum_steps" in {f.name for f in dataclasses.fields(cls)}:  # the recipes that accumulate
            sub.add_argument(
                "--fsdp-accumulate",
                default=None,
                choices=ACCUMULATE,
                help="with --accum-steps > 1 under fsdp2/hsdp: gathered (weights kept gathered and gradients "
                "unreduced through the window: k = 1's collectives, a whole copy's memory) | sharded (every "
                "micro-batch gathers and reduce-scatters: k times the collectives, shards only; under hsdp the "
                "all-reduce across hosts still once per step) | auto (gathered where it fits half the device; default "
                "$LABKIT_FSDP_ACCUMULATE, else auto); TrainConfig.fsdp_accumulate",
            )
        sub.add_argument(
            "--resume",
            nargs="?",
            const="latest",
            default=None,
            metavar="FOLDER",
            help="continue at the newest committed step: of FOLDER (a run folder), or without it of the newest "
            "run-* folder under --checkpoint-dir (resnet) or of --save-to (gpt); single process and torchrun alike",
        )
        sub.add_argument(
            "--save-every",
            type=_flag_type("save_every", int, name),
            default=None,
            metavar="N",
            help="save a checkpoint every N optimizer steps (resnet: as --checkpoint-every; gpt: into --save-to)",
        )
        sub.add_argument(
            "--meta-init",
            action="store_true",
            help="build the model on the meta device (labkit.meta_init): each process allocates only its own shards, "
            "filled with the values of the ordinary build of the same seed (the same losses); an initialisation it "
            "cannot replay is refused by name",
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
