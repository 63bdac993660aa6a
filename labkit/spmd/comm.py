"""Bytes into time: what each strategy's collectives send per device, how long that takes over a TPU
generation's inter-chip interconnect (ICI), and the batch per chip below which a step waits for the network.

    s = labkit.spmd.comm.step_comm("fsdp", params=1e9, devices=256, chip="v5e")   # bytes, seconds
    b = labkit.spmd.comm.critical_tokens("data", flops_per_s=197e12, chip="v5e")  # tokens per chip

Per device, with a ring over W devices and a buffer of V bytes (V: the whole gathered result, the whole
unreduced input, the whole summed buffer):

    all-gather      V·(W−1)/W      each device receives the W−1 slices it lacks and forwards as much
    reduce-scatter  V·(W−1)/W      the mirror image: W−1 partial slices sent, each added on the way
    all-reduce    2·V·(W−1)/W      a reduce-scatter then an all-gather

So textbook FSDP (ZeRO-3: each weight all-gathered for the forward and again for the backward, each gradient
reduce-scattered) sends 3·V·(W−1)/W per step where data parallelism (one all-reduce of the gradients) sends
2·V·(W−1)/W: 1.5x, not the 3x that adding the buffers of different collectives suggests.

The ICI figures are Google Cloud's TPU pages (read 2026-11; not verified here: no TPU). A chip's links carry
data both ways at once; what limits a collective is what one chip can send, half the "bidirectional" figure,
and only when every port of the chip carries the collective (a ring laid along one axis of a 2-D torus uses 2
of a v5e's 4 ports: pass `ports`). Compute time assumes the chip's peak FLOP/s (scale by an MFU) and perfect
overlap of communication with the compute that runs while it can (see critical_tokens); real steps do worse on
both counts.

The ring figures assume a ring: an axis whose ends are joined by a wraparound link. Wraparound exists only on axes
of 16 chips on v5e and v6e, and only on slices made of whole 4x4x4 cubes on v4 and v5p: full pods and large slices.
The source is the JAX team's book *How to Scale Your Model* (its TPU chapter); Google Cloud's TPU pages list the
slice shapes without stating the rule. The slices a learner rents
(v5e-8 is 2x4, v4-8 is 2x2x1) have none: a collective along an axis without wraparound runs over a line, not a
ring, which sends in one direction over the longest path and takes roughly twice the ring's time (pass half the
ports, or double the seconds, for such slices: `ring_seconds(..., wraparound=False)`, and `wraparound` says which
axes of a slice have it). Not verified here: no TPU.

Overlap (`exposed_seconds`): a gradient's reduction can run only while the backward of the layers below it goes
on; the reductions share the links, so they queue in the order the backward produces the gradients, and the
last gradient computed (the first layer's) has nothing left to hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ici:
    """One TPU generation's inter-chip interconnect, as Google's pages give it."""

    chip: str
    send_bytes_per_s: float  # what one chip can send, every port busy (half the bidirectional figure)
    ports: int  # ICI ports per chip (2-D torus: 4; 3-D: 6)
    source: str

    def seconds(self, nbytes: float, ports: int | None = None) -> float:
        """Time to send `nbytes` from one chip over `ports` of its ports (default: all of them)."""
        used = self.ports if ports is None else ports
        if not 0 < used <= self.ports:
            raise ValueError(f"{self.chip} has {self.ports} ICI ports, not {used}")
        return nbytes / (self.send_bytes_per_s * used / self.ports)


# Google Cloud TPU pages (docs.cloud.google.com/tpu/docs/<v>), read 2026-11, not verified here (no TPU):
# v5e "Bidirectional ICI bandwidth (per chip) 400 GBps", 4 ports, 2-D torus; its pod line "All-reduce bandwidth
# per Pod 51.2 TB/s" over 256 chips is the same 200 GB/s a chip sends. v6e: 800 GBps, 4 ports, 2-D torus (pod:
# 102.4 TB/s / 256 = 400 GB/s). v5p ("v5p training"): 1200 GBps, 3-D torus (6 ports). v4's page gives no
# per-chip ICI figure: its "All-reduce bandwidth per Pod 1.1 PB/s" over the pod's 4096 chips, the rule that
# holds for v5e and v6e, gives ~269 GB/s sent per chip (derived here), 3-D torus (6 ports).
ICI = {
    "v4": Ici("v4", 1.1e15 / 4096, 6, "tpu/docs/v4: all-reduce bandwidth per Pod 1.1 PB/s / 4096 chips (derived)"),
    "v5e": Ici("v5e", 400e9 / 2, 4, "tpu/docs/v5e: bidirectional ICI bandwidth per chip 400 GBps, 4 ports"),
    "v5p": Ici("v5p", 1200e9 / 2, 6, "tpu/docs/v5p-training: bidirectional ICI bandwidth per chip 1200 GBps"),
    "v6e": Ici("v6e", 800e9 / 2, 4, "tpu/docs/v6e: bidirectional ICI bandwidth per chip 800 GBps, 4 ports"),
}
POD_ALL_REDUCE = {"v4": (1.1e15, 4096), "v5e": (51.2e12, 256), "v6e": (102.4e12, 256)}  # (bytes/s, chips)

# bytes one device sends per byte of the collective's buffer, as a multiple of (W-1)/W (ring algorithms)
RING_FACTOR = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1}


def sent(op: str, nbytes: float, devices: int) -> float:
    """Bytes one device sends for collective `op` over `devices` devices on a buffer of `nbytes` (the
    whole buffer: gathered result, unreduced input, summed tensor, exchanged array). A collective-permute
    sends its whole buffer to one peer."""
    if devices < 1:
        raise ValueError(f"devices={devices}")
    if op == "collective-permute":  # HLO gives it source-target pairs, not replica groups: whatever `devices` says
        return float(nbytes)
    if op not in RING_FACTOR:
        raise ValueError(f"unknown collective {op!r}: one of {sorted(RING_FACTOR) + ['collective-permute']}")
    return RING_FACTOR[op] * nbytes * (devices - 1) / devices


LINE_FACTOR = 2  # an axis without wraparound is a line: about twice a ring's time (module docstring)


def wraparound(chip: str, shape) -> tuple[bool, ...]:
    """Which axes of a `chip` slice of `shape` (chips per axis: a v5e-8 is (2, 4), a v5e-256 (16, 16), a v4-8
    (2, 2, 1)) close into a ring with a wraparound link. After *How to Scale Your Model*'s TPU chapter (not verified
    here): v5e and v6e (2-D) wrap an axis only when it has 16 chips; v4 and v5p (3-D) wrap only slices made
    of whole 4x4x4 cubes (every axis a multiple of 4), and then every axis."""
    ici(chip)
    dims = tuple(shape)
    want = 2 if chip in ("v5e", "v6e") else 3
    if len(dims) != want or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(f"a {chip} slice's shape is {want} positive whole numbers of chips per axis, not {shape!r}")
    if want == 2:
        return tuple(d == 16 for d in dims)
    return (all(d % 4 == 0 for d in dims),) * 3


def ring_seconds(op: str, nbytes: float, devices: int, send_bytes_per_s: float, wraparound: bool = True) -> float:
    """Seconds for collective `op` on a buffer of `nbytes` along one axis of `devices` chips, each chip sending
    `send_bytes_per_s` over the ports that axis uses: sent(op, nbytes, devices) / send_bytes_per_s when the axis is a
    ring (its ends joined by a wraparound link: see `wraparound` for which axes are, after Google's TPU pages), and
    LINE_FACTOR (2) times that when it is a line (no wraparound): a ring laid on a line comes back over the same
    links, so each link's two directions carry one ring where a closed axis runs two (one each way), and a chip
    sends at half the rate. An estimate, not a measurement (no TPU here)."""
    if send_bytes_per_s <= 0:
        raise ValueError(f"send_bytes_per_s={send_bytes_per_s}: a rate is positive")
    return sent(op, nbytes, devices) / send_bytes_per_s * (1 if wraparound else LINE_FACTOR)


def exposed_seconds(backward_s, reduce_s) -> float:
    """Seconds a step waits for gradient reductions after its backward ends, with perfect overlap otherwise.
    `backward_s[i]`: the backward time of layer i, `reduce_s[i]`: its gradient's reduction time, both in the order
    the backward runs (index 0: the last layer, computed first). Gradient i exists once backward_s[0..i] are done;
    the reductions share the links, so reduction i starts at the later of that moment and the end of reduction
    i-1. What is left after the backward (at least the last reduction: the first layer's gradient has nothing to
    hide behind) is what the optimizer step waits for."""
    b, r = [float(x) for x in backward_s], [float(x) for x in reduce_s]
    if not b or len(b) != len(r) or any(not x >= 0 for x in b + r):  # `not x >= 0` is true for NaN too
        raise ValueError(f"one backward time and one reduction time (>= 0) per layer, got {len(b)} and {len(r)}")
    ready = end = 0.0
    for back, red in zip(b, r):
        ready += back
        end = max(ready, end) + red
    return end - ready


def traffic(ops) -> float:
    """Bytes one device sends for a list of collectives as labkit.spmd.sharding.collective_ops reads them from
    the optimized HLO ({"op", "bytes", "group"}): each at its own ring factor and group size. This, not the sum
    of the buffers, is what compares strategies."""
    return sum(sent(o["op"], o["bytes"], o["group"]) for o in ops)


def strategy_collectives(strategy: str, params: float, devices: int, bytes_per: int = 2) -> list[dict]:
    """The textbook collectives of one training step, as {"op", "bytes", "group"} (the form `traffic` reads):
    data: one all-reduce of the gradients; fsdp (ZeRO-3): the weights all-gathered twice (forward, backward)
    and the gradients reduce-scattered. `params` weights of `bytes_per` bytes (bf16: 2), gradients alike."""
    v = params * bytes_per
    if strategy == "data":
        return [{"op": "all-reduce", "bytes": v, "group": devices}]
    if strategy == "fsdp":
        return [{"op": "all-gather", "bytes": v, "group": devices}] * 2 + [
            {"op": "reduce-scatter", "bytes": v, "group": devices}
        ]
    raise ValueError(f"strategy {strategy!r}: 'data' or 'fsdp' (tensor parallelism: megatron_collectives)")


def megatron_collectives(tokens: float, width: int, layers: int, model: int, bytes_per: int = 2) -> list[dict]:
    """Megatron tensor parallelism's activation all-reduces in one step: 4 per block (2 forward, 2 backward)
    of (tokens, width) activations, `tokens` being one data slice's (batch/data x context), over `model`
    devices. The gradients of the weights left whole, summed over the data axis, come on top."""
    return [{"op": "all-reduce", "bytes": tokens * width * bytes_per, "group": model}] * (4 * layers)


def ici(chip: str) -> Ici:
    if chip not in ICI:
        raise ValueError(f"no ICI figure for {chip!r}: one of {sorted(ICI)}")
    return ICI[chip]


def step_comm(strategy: str, params: float, devices: int, chip: str, bytes_per: int = 2, ports=None) -> dict:
    """{"bytes": sent per device per step, "seconds": over `chip`'s ICI} for the textbook step of a strategy."""
    b = traffic(strategy_collectives(strategy, params, devices, bytes_per))
    return {"bytes": b, "seconds": ici(chip).seconds(b, ports)}


def compute_seconds(params: float, tokens_per_chip: float, flops_per_s: float, mfu: float = 1.0) -> float:
    """One chip's training step: 6 FLOPs per weight per token (forward 2, backward 4), at `mfu` of the peak."""
    return 6 * params * tokens_per_chip / (flops_per_s * mfu)


def critical_tokens(
    strategy: str, flops_per_s: float, chip: str, devices: int | None = None, bytes_per: int = 2, mfu=1.0, ports=None
) -> float:
    """Tokens per chip per step at which compute time equals the communication it can hide behind (scaling-book's
    critical batch, "How to Parallelize a Transformer for Training"): fewer, and the step waits for the network
    even with perfect overlap. A collective can only overlap compute that runs while its data exists: the
    gradients appear during the backward (4 of the 6 FLOPs per weight and token), so data parallelism's
    all-reduce hides behind the backward alone, never behind the forward. FSDP splits its traffic the same way:
    one all-gather behind the forward (2 FLOPs), an all-gather and a reduce-scatter behind the backward (4). The
    weight count cancels and both give the same bound, scaling-book's "compute-bound above C / W_ici" per axis:

        data:  4·N·b/F = 2·N·g·(W−1)/W / S                 ->  b* = g·(W−1)/W · F / (2·S)
        fsdp:  2·N·b/F = N·g·(W−1)/W / S  (forward), 4·N·b/F = 2·N·g·(W−1)/W / S (backward): the same b*

    F: FLOP/s at the MFU reached, S: bytes a chip sends per second over the ports the ring uses, g: bytes per
    weight and gradient. devices=None: the large-W limit ((W−1)/W -> 1). FSDP sends 1.5x the bytes of data
    parallelism but has the forward to hide a third of them behind, so its bound is no higher."""
    w = 1.0 if devices is None else (devices - 1) / devices
    # bytes sent per weight (in units of g·w), and FLOPs per weight and token of the compute they overlap:
    # data: 2 behind the backward's 4; fsdp: forward 1 behind 2, backward 2 behind 4 (the same ratio)
    phases = {"data": [(2, 4)], "fsdp": [(1, 2), (2, 4)]}.get(strategy)
    if phases is None:
        raise ValueError(f"strategy {strategy!r}: 'data' or 'fsdp' (tensor parallelism: critical_width)")
    send = ici(chip).send_bytes_per_s if ports is None else ici(chip).send_bytes_per_s * ports / ici(chip).ports
    return max(nb * bytes_per * w * flops_per_s * mfu / (fl * send) for nb, fl in phases)


def critical_width(model: int, flops_per_s: float, chip: str, bytes_per: int = 2, mfu=1.0, ports=None) -> float:
    """Megatron over `model` devices: the model width C at which a block's compute equals its activation
    all-reduces. Per block and token: compute 72·C²/M FLOPs (12·C² weights, 6 FLOPs each, split M ways),
    communication 4 all-reduces of C·g bytes, 8·C·g·(M−1)/M sent. The batch cancels: tensor parallelism is
    bound by width per device, not by batch. Compute-bound when C ≥ g·(M−1)·F / (9·S)."""
    send = ici(chip).send_bytes_per_s if ports is None else ici(chip).send_bytes_per_s * ports / ici(chip).ports
    return bytes_per * (model - 1) * flops_per_s * mfu / (9 * send)


def max_model_axis(width: int, flops_per_s: float, chip: str, bytes_per: int = 2, mfu=1.0) -> int:
    """The most devices a Megatron model axis can span at `width` and stay compute-bound."""
    m = 1
    while critical_width(m + 1, flops_per_s, chip, bytes_per, mfu) <= width:
        m += 1
    return m


def fits(params: float, hbm_bytes: float, devices: int, strategy: str, state_bytes_per_weight: int = 16) -> bool:
    """Whether weights, gradients and AdamW state fit one chip's memory (activations not counted). Mixed
    precision with fp32 master weights: 16 bytes a weight (bf16 weight 2 + bf16 grad 2 + fp32 master 4 + two
    fp32 moments 8) under data parallelism; FSDP splits all of it over the devices."""
    per_device = params * state_bytes_per_weight / (devices if strategy == "fsdp" else 1)
    return per_device <= hbm_bytes
