"""Mixed precision that fits the chip: the one place that decides bf16, fp16 + loss scaling, or fp32, and
the one object that carries it out (autocast, the scaled backward, unscale/clip/step/update, the loss scale).

    prec = labkit.precision.choose(rt, "auto")     # or "bf16" | "fp16" | "fp32" | "true" | "false"
    trainer = labkit.Trainer(model, opt, rt, cfg, loader, precision=prec)
    peak, _ = labkit.dashboard.flops.peak_flops(rt, prec.name)
    with prec.autocast(): loss = loss_fn(model(x), y)   # by hand, what the Trainer does:
    prec.backward(loss); prec.step(optimizer, clip_norm=1.0)

- TPU: bf16 autocast. The MXU multiplies in bf16 natively; bf16 keeps fp32's exponent range, so no
  loss scaling is needed.
- CUDA with compute capability >= 8.0 (A100, L4, H100): bf16 autocast, for the same reasons.
- CUDA below 8.0 (T4 = 7.5, V100 = 7.0): these tensor cores do fp16, not bf16 (bf16 there is emulated
  and slower than fp32). fp16 autocast needs a GradScaler: fp16's 5-bit exponent flushes small
  gradients to zero unless the loss is scaled up before backward and the gradients down before the step.
- CPU and XLA:CPU: fp32. CPU matmuls gain nothing from bf16 autocast for learning-sized runs; on
  XLA:CPU "true" still gives bf16 autocast, so the TPU code path can be exercised on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from labkit.config import parse_bool

MODES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16" | "fp16" | "fp32": what the matmuls compute in (flops.peak_flops takes it)
    device_type: str  # autocast's device type: "xla" | "cuda" | "cpu" | "tpu" (TorchTPU)
    reason: str
    # fp16 only: the GradScaler this precision steps through (its loss scale is state, saved in checkpoints)
    scaler: object = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.needs_scaler:
            object.__setattr__(self, "scaler", torch.amp.GradScaler(self.device_type))

    def fresh(self) -> Precision:
        """The same choice with its own loss scale: a GradScaler's state belongs to one run (the Trainer's)."""
        return dataclasses.replace(self)

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.name)

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        """The autocast context for forward passes (a no-op context for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self):
        """This precision's GradScaler under fp16, else None (bf16 and fp32 need no loss scaling)."""
        return self.scaler

    def backward(self, loss) -> None:
        """loss.backward(), scaled first under fp16: the GradScaler keeps small gradients from flushing to 0."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer, clip_norm: float | None = None):
        """unscale -> clip -> step -> update. Returns the pre-clip gradient norm tensor when clip_norm is set,
        else None. Under fp16 the GradScaler skips a step whose gradients hold inf/NaN and lowers its scale."""
        norm = None
        if clip_norm is not None:
            if self.scaler is not None:  # the clip must see the true gradients, not the scaled ones
                self.scaler.unscale_(optimizer)
            # torch's own: the scale factor stays a tensor (clamp(max_norm / norm, max=1)), so no .item() and no
            # host sync as long as error_if_nonfinite stays False (its default)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def scale(self) -> float | None:
        """The loss scale now, as a Python number (fp16), else None. A host read: once per fit(), not per step."""
        return self.scaler.get_scale() if self.scaler is not None else None

    def scale_tensor(self):
        """The loss scale after the last step as a device tensor of its own (fp16), else None: no host sync.
        A step the GradScaler skipped lowered it, so the per-step scales count skipped steps (labkit.steplog).
        get_scale() would .item() it; _get_scale_async is torch's (checked on 2.9); the scaler updates it in
        place, hence the copy."""
        return self.scaler._get_scale_async().detach().clone() if self.scaler is not None else None

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the GradScaler's loss scale and counters under fp16, else {}."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def parse_mode(want) -> str:
    """What a precision setting asks for: one of MODES, "auto16" (true: the 16-bit type that fits the chip) or
    "fp32" (false); ValueError naming the value otherwise. Read by choose() and by the command line's --precision."""
    if isinstance(want, bool):
        return "auto16" if want else "fp32"
    low = str(want).strip().lower()
    if low in MODES:
        return low
    if low:  # true: "mixed precision, please" - the 16-bit type that fits the chip
        with contextlib.suppress(ValueError):
            return "auto16" if parse_bool(low, "precision") else "fp32"
    raise ValueError(f"precision {want!r} is not one of {', '.join(MODES)} (or true/false)")


def cuda_capability(device=None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def choose(rt, want="auto") -> Precision:
    """The precision to train in on rt's chip. want: auto | bf16 | fp16 | fp32 | true | false (or a bool).
    'auto' turns mixed precision on where the chip has matrix units for it; 'true' asks for it anywhere
    it can run. An explicit dtype the chip cannot do well raises ValueError naming the chip and the fix.
    The backend picks which of the rules below is its own (labkit.runtime: precision_for)."""
    mode = parse_mode(want)
    return rt.precision_for(mode, want) if rt is not None else for_cpu(mode, want)


def for_tpu(mode: str, want) -> Precision:
    if mode == "fp32":
        return Precision("fp32", "xla", f"asked for ({want!r})")
    if mode == "fp16":
        raise ValueError("fp16 on a TPU: the MXU computes in bf16; use 'bf16' (or 'auto')")
    return Precision("bf16", "xla", "TPU: the MXU computes in bf16")


def for_cuda(mode: str, want, device=None) -> Precision:
    if mode == "fp32":
        return Precision("fp32", "cuda", f"asked for ({want!r})")
    cap = cuda_capability(device)
    name = torch.cuda.get_device_name(device)
    cc = f"{name}, compute capability {cap[0]}.{cap[1]}"
    if cap >= (8, 0):
        if mode == "fp16":
            return Precision("fp16", "cuda", f"asked for; {cc} (bf16 would need no GradScaler)")
        return Precision("bf16", "cuda", f"{cc}: bf16 tensor cores")
    if mode == "bf16":
        raise ValueError(
            f"bf16 on {cc}: no bf16 tensor cores below 8.0 (emulated, slower than fp32); "
            "use 'fp16' (autocast + GradScaler) or 'auto'"
        )
    return Precision("fp16", "cuda", f"{cc}: fp16 tensor cores, no bf16; with a GradScaler")


def for_xla_cpu(mode: str, want) -> Precision:
    if mode == "fp32":
        return Precision("fp32", "xla", f"asked for ({want!r})")
    if mode in ("bf16", "auto16"):
        return Precision("bf16", "xla", "asked for on XLA:CPU (exercises the TPU's bf16 code path)")
    if mode == "fp16":
        raise ValueError("fp16 on XLA:CPU is not supported by labkit: use 'bf16' or 'fp32'")
    return Precision("fp32", "xla", "XLA:CPU: no 16-bit matrix units (pass 'true' to exercise bf16)")


def for_cpu(mode: str, want) -> Precision:
    if mode == "fp32":
        return Precision("fp32", "cpu", f"asked for ({want!r})")
    if mode in ("bf16", "fp16"):
        raise ValueError(f"{mode} on plain CPU: autocast there only slows learning-sized runs; use 'fp32' or 'auto'")
    return Precision("fp32", "cpu", "CPU: no 16-bit matrix units worth using")
