"""Run configuration: a dataclass with literal defaults and one environment overlay.

    cfg = TrainConfig.from_env(lr=0.05)     # LABKIT_FAST=1 -> a CI-sized run
    cfg = from_env(MyParams)                # the same for any dataclass of your own

Order of precedence (last wins): literal defaults, the FAST overlay when LABKIT_FAST=1,
LABKIT_<FIELD> environment variables (e.g. LABKIT_BATCH_SIZE=64), explicit keyword overrides.
The config is saved inside every checkpoint (`dataclasses.asdict`).
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass


def fast_mode() -> bool:
    """True when LABKIT_FAST asks for a CI-sized run."""
    return os.environ.get("LABKIT_FAST", "0").strip().lower() in ("1", "true", "yes", "on")


def _parse(name: str, raw: str, typ):
    origin = typing.get_origin(typ)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        typ = args[0]
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ in (int, float, str):
            return typ(raw)
    except ValueError:
        raise ValueError(f"environment variable LABKIT_{name.upper()}={raw!r} is not a valid {typ.__name__}") from None
    raise TypeError(f"field {name!r} of type {typ} cannot be set from the environment")


def from_env(cls, fast: dict | None = None, prefix: str = "LABKIT_", **overrides):
    """Build dataclass `cls`: defaults, then `fast` (or cls.FAST) if LABKIT_FAST=1, then env, then overrides."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}; fields: {sorted(names)}")
    values: dict = {}
    if fast_mode():
        values.update(fast if fast is not None else getattr(cls, "FAST", {}))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        raw = os.environ.get(prefix + f.name.upper())
        if raw is not None and f.name != "fast":
            values[f.name] = _parse(f.name, raw, hints[f.name])
    values.update(overrides)
    return cls(**values)


@dataclass
class TrainConfig:
    """Knobs of labkit's training loop (see labkit.loop.Trainer)."""

    epochs: int = 1
    max_steps: int = 0              # 0: no cap; otherwise stop after this many optimizer steps
    batch_size: int = 128           # per replica
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float = 0.0          # 0: no clipping
    bf16: bool = False              # autocast to bfloat16 on XLA/CUDA
    log_every: int = 20             # read metrics every N steps (one device->host transfer each)
    log_seconds: float = 0.0        # ... or every T seconds of host time, whichever comes first (0: off)
    eval_every: int = 1             # evaluate every N epochs (0: never)
    warmup_steps: int = 2           # compiles before this step are expected (graph + optimizer state)
    seed: int = 0
    checkpoint_every: int = 0       # save every N steps (0: only at epoch end when a manager is given)
    resume: bool = False            # continue from the manager's latest checkpoint
    num_workers: int = 0            # host DataLoader workers

    FAST: typing.ClassVar[dict] = {"epochs": 1, "max_steps": 30, "batch_size": 8, "log_every": 5}

    @classmethod
    def from_env(cls, **overrides) -> "TrainConfig":
        return from_env(cls, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
