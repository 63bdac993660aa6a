"""Run configuration: a dataclass with literal defaults and one environment overlay.

    cfg = TrainConfig.from_env(max_steps=200)   # LABKIT_FAST=1 -> a CI-sized run
    cfg = from_env(MyParams)                    # the same for any dataclass of your own

Order of precedence (last wins): literal defaults, the FAST overlay when LABKIT_FAST=1,
LABKIT_<FIELD> environment variables (e.g. LABKIT_MAX_STEPS=64), explicit keyword overrides.
The config is saved inside every checkpoint (`dataclasses.asdict`).

Nothing is ignored silently: a value that does not parse (LABKIT_FAST=maybe, LABKIT_EPOCHS=two)
names the variable; a LABKIT_ variable that is neither a field of the dataclass being read nor a
known non-config name (NON_CONFIG_ENV) but looks like one of its fields (LABKIT_EPOCSH) is an
error with a "did you mean"; out-of-range values (negative epochs, NaN clip norm) are rejected
by TrainConfig itself. Names that look like nothing in the dataclass are left alone: they may
belong to another dataclass (a notebook's Params) read elsewhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")

# LABKIT_ variables that are read by labkit itself (not dataclass fields): never "typos".
NON_CONFIG_ENV = frozenset(
    {
        "LABKIT_FAST",  # CI-sized runs (fast_mode)
        "LABKIT_BACKEND",  # labkit.setup(): force tpu / cuda / xla-cpu / cpu
        "LABKIT_COMPILE_CACHE",  # labkit.setup(): persistent XLA compile cache (yes/no/auto/a folder)
        "LABKIT_CONSOLE",  # dashboard: console lines instead of widgets
        "LABKIT_PIP_SPEC",  # the notebooks' set-up cell: what pip installs
        "LABKIT_ARTIFACTS",  # where notebook runs keep their outputs
        "LABKIT_SOLUTIONS",  # notebooks: run the hidden exercise solutions (labkit.lessons.exercises)
        "LABKIT_HOST_ROOT",  # host-side data/cache root
        "LABKIT_CACHE",  # shard cache folder
        "LABKIT_PEAK_FLOPS",  # MFU denominator override
    }
)


def parse_bool(value, name: str) -> bool:
    """The one parser for yes/no settings: 1/true/yes/on and 0/false/no/off/'' (any case).
    Anything else raises ValueError naming the setting: 'maybe' is not silently off."""
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (use one of {', '.join(TRUE)} / {', '.join(FALSE[:-1])})")


BF16_REMOVED = (
    "mixed precision is chosen by labkit.precision: pass "
    'precision=labkit.precision.choose(rt, "bf16") to the Trainer (or "auto" / "fp16" / "fp32"); '
    "the notebooks and labkit.train read LABKIT_PRECISION / --precision"
)


def fast_mode() -> bool:
    """True when LABKIT_FAST asks for a CI-sized run."""
    return parse_bool(os.environ.get("LABKIT_FAST", "0"), "LABKIT_FAST")


def _parse(name: str, raw: str, typ, var: str):
    origin = typing.get_origin(typ)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        typ = args[0]
    if typ is bool:
        return parse_bool(raw, f"environment variable {var}")
    try:
        if typ in (int, float, str):
            value = typ(raw)
            if typ is float and not math.isfinite(value):
                raise ValueError(raw)
            return value
    except ValueError:
        what = "finite float" if typ is float else typ.__name__
        raise ValueError(f"environment variable {var}={raw!r} is not a valid {what}") from None
    raise TypeError(f"field {name!r} of type {typ} cannot be set from the environment")


def _check_env_names(cls, names: set, prefix: str) -> None:
    """A LABKIT_ variable close to a field name but not equal to it is almost surely a typo."""
    upper = {prefix + n.upper(): n for n in names}
    for var in os.environ:
        if not var.startswith(prefix) or var in upper or var in NON_CONFIG_ENV:
            continue
        # compare the part after the prefix: the shared prefix would make every name look close
        close = difflib.get_close_matches(var[len(prefix) :].lower(), sorted(names), n=1, cutoff=0.8)
        if close:
            raise ValueError(
                f"environment variable {var} is not a setting of {cls.__name__}; "
                f"did you mean {prefix}{close[0].upper()}? "
                f"(settings: {', '.join(sorted(upper))})"
            )


def from_env(cls, fast: dict | None = None, prefix: str = "LABKIT_", **overrides):
    """Build dataclass `cls`: defaults, then `fast` (or cls.FAST) if LABKIT_FAST=1, then env, then overrides."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}; fields: {sorted(names)}")
    _check_env_names(cls, names, prefix)
    if "bf16" not in names and os.environ.get(prefix + "BF16") is not None:
        raise ValueError(f"environment variable {prefix}BF16 is no longer read: {BF16_REMOVED}")
    values: dict = {}
    if fast_mode():
        values.update(fast if fast is not None else getattr(cls, "FAST", {}))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        var = prefix + f.name.upper()
        raw = os.environ.get(var)
        if raw is not None and f.name != "fast":
            values[f.name] = _parse(f.name, raw, hints[f.name], var)
    values.update(overrides)
    obj = cls(**values)
    check_ranges(obj)
    return obj


# settings that must be > 0 whatever dataclass holds them (a notebook's Params, a script's)
POSITIVE = ("batch_size", "lr")


def check_number(name: str, value, *, low: float = 0, above: bool = False, high: float | None = None, integer=False):
    """`value` if it is a real number (not a bool: True is 1 to Python, never a batch size), finite, >= `low` (> `low`
    when `above`), <= `high` when given, and an int when `integer`; else ValueError naming `name`. The one check
    every public number of labkit goes through (settings, learning rates, batch sizes)."""
    kind = "an integer" if integer else "a finite number"
    bound = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    wrong = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if not wrong:
        wrong = (
            not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value > high)
        )
    if wrong:
        raise ValueError(f"{name}={value!r}: expected {kind} {bound}")
    return value


def check_ranges(obj) -> None:
    """Numbers in a settings dataclass: finite and >= 0 (a count, a rate, a size), and > 0 for the
    POSITIVE names; a bool given to a number field is refused (True would train with batch 1). A dataclass lists
    the fields that may go below 0 in a ClassVar SIGNED.
    Raises ValueError naming the setting: batch 0, epochs -1 or lr -0.1 never reach a training run."""
    signed = set(getattr(obj, "SIGNED", ()))
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        where = f"{type(obj).__name__}.{f.name}"
        if isinstance(v, bool) and hints.get(f.name) in (int, float):
            raise ValueError(f"{where}={v!r}: expected a number, not a bool")
        if f.name in signed or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        check_number(where, v, above=f.name in POSITIVE)


COMPILE = ("auto", "on", "off")
PARALLEL = ("auto", "replicate", "fsdp2", "hsdp")  # TrainConfig.parallel (labkit.parallel's plans)
ACCUMULATE = ("auto", "gathered", "sharded")
MEMORY_FORMATS = (
    "auto",
    "channels_last",
    "contiguous",
    "probe",
)  # TrainConfig.memory_format (labkit.runtime.layout)  # TrainConfig.fsdp_accumulate (labkit.parallel.FullyShard)


def _compile_setting(value) -> str:
    """TrainConfig.compile as one of COMPILE: 'auto', or a yes/no (parse_bool's spellings, bools) as on/off."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if parse_bool(value, "TrainConfig.compile") else "off"
    except ValueError:
        raise ValueError(
            f"TrainConfig.compile={value!r}: expected one of {', '.join(COMPILE)} (or true/false)"
        ) from None


@dataclass
class TrainConfig:
    """Knobs that labkit's training loop reads (see labkit.loop.Trainer). What only a notebook
    reads (learning rate, batch size, seed, workers) lives in the notebook's own Params."""

    epochs: int = 1
    max_steps: int = 0  # 0: no cap; otherwise stop after this many optimizer steps
    clip_norm: float = 0.0  # 0: no clipping
    log_every: int = 20  # read metrics every N steps (one device->host transfer each)
    log_seconds: float = 0.0  # ... or every T seconds of host time, whichever comes first (0: off)
    eval_every: int = 1  # evaluate every N epochs (0: never)
    warmup_steps: int = 2  # compiles before this step are expected (graph + optimizer state)
    checkpoint_every: int = 0  # save every N steps (0: only at epoch end when a manager is given)
    resume: bool = False  # continue from the manager's latest checkpoint
    # a NaN/inf loss (seen at log time, where the loss is read anyway: no extra host sync) stops the
    # run with the step number; True only warns and trains on
    continue_on_nonfinite: bool = False
    # fp16 + GradScaler: this many skipped steps in a row (inf/NaN gradients under a finite loss) stop the
    # run like a NaN loss does (continue_on_nonfinite=True only warns); 0: never
    max_skipped_steps: int = 10
    # how the step is captured off XLA (labkit.runtime.step): "on" compiles forward + backward and the optimizer step
    # with torch.compile, "off" runs them eagerly, "auto" compiles where it pays: when the run's planned steps exceed
    # the compile's payback on that device (labkit.runtime.step.PAYBACK_STEPS: never on the plain CPU; 5,639 steps on
    # CUDA, both measured), never on XLA (its lazy trace is its compiler; "on" there is refused).
    # True/False and yes/no read as on/off
    compile: str = "auto"
    compile_backend: str = "inductor"  # torch.compile's backend= ("tpu" would be TorchTPU's)
    # gradient accumulation: one optimizer step per accum_steps micro-batches (each loss divided by it), so a step
    # trains on batch x world size x accum_steps samples. `step`, max_steps, log_every, checkpoint_every and the
    # scheduler count optimizer steps; checkpoints are taken only between optimizer steps (labkit.loop)
    accum_steps: int = 1
    # how the model is laid out over torchrun's processes (labkit.parallel): "replicate" (DDP, a whole copy each),
    # "fsdp2" (fully_shard per block, then the root), "hsdp" (sharded within a host, replicated across hosts: a 2-D
    # mesh), "auto" (replicate where weights + gradients + AdamW state fit half a device, else hsdp on several hosts
    # where a host's share fits, else fsdp2). One process, XLA and SPMD: "auto" only
    parallel: str = "auto"
    # accumulation (accum_steps > 1) under fsdp2/hsdp: "gathered" keeps each unit gathered and its gradients unreduced
    # through the window (k = 1's collectives, a whole copy's weights and gradients on every process), "sharded"
    # reduce-scatters every micro-batch (memory stays sharded, k times the collectives), "auto" gathered where that
    # fits half the device (labkit.parallel.accumulation), else sharded
    fsdp_accumulate: str = "auto"
    # how 4-D image tensors lie in memory for a model with 2-D convolutions (labkit.runtime.layout): "auto" is the
    # runtime's choice (channels_last on CUDA, contiguous on XLA and the plain CPU, said once with why),
    # "channels_last" / "contiguous" force one, "probe" measures this machine's convolutions in both first
    memory_format: str = "auto"
    # removed: mixed precision is labkit.precision's alone (Trainer(..., precision=choose(rt, "bf16")))
    bf16: dataclasses.InitVar[None] = None

    FAST: typing.ClassVar[dict] = {"epochs": 1, "max_steps": 30, "log_every": 5}

    def __post_init__(self, bf16=None):
        if bf16 is not None:
            raise TypeError(f"TrainConfig(bf16={bf16!r}): {BF16_REMOVED}")
        for name in (
            "epochs",
            "max_steps",
            "log_every",
            "eval_every",
            "warmup_steps",
            "checkpoint_every",
            "max_skipped_steps",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name}={v!r}: expected an integer >= 0")
        if isinstance(self.accum_steps, bool) or not isinstance(self.accum_steps, int) or self.accum_steps < 1:
            raise ValueError(
                f"TrainConfig.accum_steps={self.accum_steps!r}: expected an integer >= 1 (1: no accumulation)"
            )
        for name in ("clip_norm", "log_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"TrainConfig.{name}={v!r}: expected a finite number >= 0")
        for name in ("resume", "continue_on_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: expected True or False")
        self.compile = _compile_setting(self.compile)
        if self.parallel not in PARALLEL:
            raise ValueError(f"TrainConfig.parallel={self.parallel!r}: expected one of {', '.join(PARALLEL)}")
        if self.fsdp_accumulate not in ACCUMULATE:
            raise ValueError(
                f"TrainConfig.fsdp_accumulate={self.fsdp_accumulate!r}: expected one of {', '.join(ACCUMULATE)}"
            )
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(
                f"TrainConfig.memory_format={self.memory_format!r}: expected one of {', '.join(MEMORY_FORMATS)}"
            )
        if not isinstance(self.compile_backend, str) or not self.compile_backend.strip():
            raise ValueError(
                f"TrainConfig.compile_backend={self.compile_backend!r}: expected a torch.compile backend name"
            )

    @classmethod
    def from_env(cls, **overrides) -> TrainConfig:
        return from_env(cls, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
