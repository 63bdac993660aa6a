"""What the dashboard looks like: the console line, the notebook header and the matplotlib figure.

    from labkit.dashboard.view import render, summary_line
    fig = render(dash.view_data())      # a matplotlib Figure of a Dashboard's history and last frame
    print(summary_line(dash.frame()))   # the console twin's one line

Pure formatting of plain data that labkit.dashboard collected: nothing here reads the device or
the Dashboard object.
"""

from __future__ import annotations

import math
import textwrap


def _fmt_n(x, unit="") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}{unit}"
    return f"{x:.3g}{unit}"


def _fmt_t(s) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _eta(f: dict) -> str:
    """What is left: an estimate while the run goes, and what became of it in the fit's last frame."""
    if f.get("final"):
        return "finished" if not f.get("total") or f["step"] >= f["total"] else f"stopped at {f['step']}/{f['total']}"
    return f"ETA {_fmt_t(f.get('eta_s'))}"


def summary_line(f: dict) -> str:
    """The compact one-line form of a frame (the console twin prints it)."""
    tot = f"/{f['total']}" if f.get("total") else ""
    parts = [f"[{f['title']}] step {f['step']}{tot} ep {f['epoch']}", f"loss {f['loss']:.4f}"]
    if f.get("val_loss") is not None:
        parts[-1] += f" val {f['val_loss']:.4f}"
    if f.get("acc") is not None or f.get("val_acc") is not None:
        parts.append(
            "acc " + " val ".join(f"{v:.3f}" if v is not None else "-" for v in (f.get("acc"), f.get("val_acc")))
        )
    rate = f"rate {_fmt_n(f['rate'])}/s global {_fmt_n(f['global_rate'])}/s"
    if f["world_size"] > 1:
        rate += f" ({_fmt_n(f['rate_per_replica'])}/s per replica)"
    parts.append(rate)
    if f.get("tokens_per_s") is not None:
        parts.append(f"{_fmt_n(f['tokens_per_s'])} tok/s")
    if f.get("mfu") is not None:
        parts.append(f"MFU {100 * f['mfu']:.1f}%")
    if f.get("data_wait_frac") is not None:
        parts.append(f"data wait {100 * f['data_wait_frac']:.0f}%")
    h = f["health"]
    if h.get("xla"):
        parts.append(
            f"compiles {h['compiles']} ({h['compile_s']:.1f}s) graphs {h['graphs_total']} xfers {h['transfers']}"
        )
    elif h.get("engine") == "torch.compile" and h.get("graphs_total"):
        parts.append(
            f"graphs {h['graphs_total']} (+{h['compiles']}, {h['compile_s']:.1f}s) recompiles {h['recompiles']} "
            f"breaks {len(h.get('breaks', []))}"
            + (f" syncs {h['transfers']}" if h.get("transfers") is not None else "")
        )
    if h.get("memory"):
        m = h["memory"]
        parts.append(f"mem {_fmt_n(m['used'], 'B')}" + (f"/{_fmt_n(m['limit'], 'B')}" if m.get("limit") else ""))
    parts.append(_eta(f))
    return " | ".join(parts)


def health_lines(f: dict) -> list[str]:
    """The health panel as lines: counts, the recompile detective's findings, graph breaks, the sync lines. XLA's
    counters on XLA, torch.compile's record elsewhere (nothing when nothing was compiled)."""
    h = f["health"]
    if h.get("engine") == "torch.compile" and (h.get("graphs_total") or h.get("breaks")):
        lines = [
            f"torch.compile: {h['compiles']} frames compiled ({h['compile_s']:.2f} s) last interval, "
            f"{h['graphs_total']} in this run, {h['recompiles']} recompiles after warm-up"
            + (f", {h['transfers']} host syncs" if h.get("transfers") is not None else "")
        ]
        owners = [b.get("owner") for b in h.get("breaks", [])]
        lines.append(
            f"graph breaks: yours: {owners.count('yours')}, labkit's: {owners.count('labkit')}, "
            f"torch's own: {len(h.get('torch_breaks', []))}"
            + (f", not known whose: {owners.count('unknown')}" if "unknown" in owners else "")
        )
        lines += [
            f"graph break at {b['site']}: {b['reason']}"
            + (" (whose: not known)" if b.get("owner") == "unknown" else "")
            for b in h.get("breaks", [])[:3]
        ]
    elif not h.get("xla"):
        return []
    else:
        lines = [
            f"XLA: {h['compiles']} compiles ({h['compile_s']:.2f} s) last interval, {h['graphs_total']} graphs "
            f"in this run, {h['recompiles']} recompiles after warm-up, {h['transfers']} transfers"
        ]
    for ev in f.get("recompiles", [])[-3:]:
        what = ", ".join(f"{c['input']} {c['old']} -> {c['new']}" for c in ev.get("changes", [])) or ev["reason"]
        lines.append(f"recompiled at step {ev['step']}: {what}" + (f"  [{ev['site']}]" if ev.get("site") else ""))
    if h.get("syncs"):
        lines.append("host syncs last interval: " + "; ".join(f"{s} x{n}" for s, n in h["syncs"][:3]))
    if h.get("fallbacks"):
        lines.append("CPU fallbacks: " + ", ".join(f"{k} x{v}" for k, v in h["fallbacks"].items()))
    return lines


def html_header(f: dict) -> str:
    """The notebook header: progress bar, the summary line, the health panel and the warnings."""
    import html as h

    pct = 100 * f["step"] / f["total"] if f.get("total") else 0
    warn = "".join(f"<li style='color:#b45309'>{h.escape(w)}</li>" for w in f["warnings"])
    bar = f"<progress value='{pct:.1f}' max='100' style='width:40%'></progress> " if f.get("total") else ""
    panel = "".join(f"<br>{h.escape(ln)}" for ln in health_lines(f)[1:])
    return (
        f"<div style='font-family:monospace'><b>{h.escape(f['title'])}</b> {bar}"
        f"{h.escape(summary_line(f))}{panel}" + (f"<ul>{warn}</ul>" if warn else "") + "</div>"
    )


def _series(ax, records: list, key: str, label: str, style: str, **kw) -> None:
    """Plot `key` against "step" over the records that have it (nothing when none has it)."""
    have = [r for r in records if key in r]
    if have:
        ax.plot([r["step"] for r in have], [r[key] for r in have], style, label=label, **kw)


def render(data: dict):
    """Loss, accuracy, throughput, XLA compiles/transfers, and a text panel (progress, health).

    data: Dashboard.view_data() - {"title", "history", "evals", "world_size", "frame", and optionally "chance"
    (accuracy of guessing, drawn as a line); rows with "tokens_per_s" make the throughput panel tokens/s}."""
    from matplotlib.figure import Figure

    rows, evals, f = data["history"], data["evals"], data["frame"]
    fig = Figure(figsize=(13, 6.5))
    # right=0.94: room for the throughput panel's second axis (its ticks and label) inside the figure
    fig.subplots_adjust(left=0.05, right=0.94, top=0.9, bottom=0.08, hspace=0.35, wspace=0.25)
    gs = fig.add_gridspec(2, 3)
    steps = [r["step"] for r in rows]
    ax = fig.add_subplot(gs[0, 0])
    _series(ax, rows, "loss", "train", "o-", ms=3)
    _series(ax, evals, "val_loss", "val", "s--", ms=6, color="C1")  # few evaluations: big markers, joined
    ax.set(title="loss", xlabel="step")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(gs[0, 1])
    _series(ax, rows, "acc", "train", "o-", ms=3, color="C0")
    _series(ax, evals, "val_acc", "val", "s--", ms=6, color="C1")
    if ax.lines:
        chance = data.get("chance")
        if chance:
            ax.axhline(chance, color="gray", ls=":", lw=1, label=f"chance ({chance:.3g})")
        ax.set_ylim(0, 1)  # an accuracy is a share: a zoomed axis makes 0.37 -> 0.39 look like a leap
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no accuracy yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set(title="accuracy", xlabel="step")
    ax = fig.add_subplot(gs[0, 2])
    # a language model's examples are sequences: show tokens/s when the dashboard knows the tokens per step
    # (tokens per example = tokens_per_s / examples_per_s of the same interval)
    per = [r["tokens_per_s"] / r["examples_per_s"] for r in rows if r.get("tokens_per_s") and r.get("examples_per_s")]
    scale, unit = (per[-1], "tokens/s") if per else (1, "examples/s")
    ax.plot(steps, [r["rate"] * scale for r in rows], "o-", ms=3, label="moving average")
    ax.plot(steps, [r["global_rate"] * scale for r in rows], "--", label="since epoch start")
    if data["world_size"] > 1:
        ax.plot(steps, [r["rate_per_replica"] * scale for r in rows], ":", label="moving average per replica")
    ax.set(title=unit, xlabel="step", ylabel=unit)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left")
    fed = [r for r in rows if "data_wait_frac" in r]
    if fed:  # the feed meter on its own axis: % of each step spent waiting for the next batch
        feed = ax.twinx()
        pct = [100 * r["data_wait_frac"] for r in fed]
        feed.plot([r["step"] for r in fed], pct, ":.", color="tab:purple", label="waiting for data")
        feed.set_ylim(0, 100)
        feed.set_ylabel("% of step waiting for data", color="tab:purple", fontsize=8)
        feed.legend(fontsize=8, loc="lower right")
    ax = fig.add_subplot(gs[1, 0])
    pre = "xla_" if any("xla_compiles" in r for r in rows) else "dynamo_"
    if any(pre + "compiles" in r for r in rows):
        ax.bar(
            steps,
            [r.get(pre + "compiles", 0) for r in rows],
            width=max(1, (steps[-1] - steps[0]) / max(len(steps), 1) * 0.4) if len(steps) > 1 else 1,
            label="compiles",
            color="tab:red",
        )
        if pre == "xla_" or any(pre + "transfers" in r for r in rows):
            ax.plot(steps, [r.get(pre + "transfers", 0) for r in rows], "k.-", label="device->host transfers")
        for i, ev in enumerate(f["recompiles"]):
            ax.axvline(ev["step"], color="tab:orange", lw=0.8, ls=":", label="recompile" if i == 0 else None)
        ax.legend(fontsize=8)
        title = "XLA per interval" if pre == "xla_" else "torch.compile per interval"
        ax.set(title=title, xlabel="step", ylabel="count per log interval")
    else:
        ax.text(0.5, 0.5, "not running on XLA", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(title="XLA", xticks=[], yticks=[])
    ax = fig.add_subplot(gs[1, 1:])
    ax.axis("off")
    lines = [
        f"{f['title']}   step {f['step']}"
        + (f"/{f['total']} ({100 * f['step'] / f['total']:.0f}%)" if f["total"] else "")
        + f"   epoch {f['epoch']}   elapsed {_fmt_t(f['elapsed_s'])}   {_eta(f)}",
        f"loss {f['loss']:.4f}"
        + (f"   val {f['val_loss']:.4f}" if f["val_loss"] is not None else "")
        + (f"   acc {f['acc']:.3f}" if f["acc"] is not None else "")
        + (f"   val acc {f['val_acc']:.3f}" if f["val_acc"] is not None else "")
        + f"   lr {f['lr']:.3g}",
        f"Rate {_fmt_n(f['rate'])}/s   since epoch start {_fmt_n(f['global_rate'])}/s   per replica "
        f"{_fmt_n(f['rate_per_replica'])}/s, {_fmt_n(f['global_rate_per_replica'])}/s (x{f['world_size']})",
    ]
    speed = []  # only what was given: a CNN has no tokens, a run without FLOPs per step no MFU
    if f["tokens_per_s"] is not None:
        speed.append(f"tokens/s {_fmt_n(f['tokens_per_s'])}")
    if f["mfu"] is not None:
        speed.append(f"MFU {100 * f['mfu']:.1f}%")
    elif data.get("tokens_per_step") or f["tokens_per_s"] is not None:
        speed.append("MFU - (peak unknown)")
    if speed:
        lines.append("   ".join(speed))
    if f.get("data_wait_frac") is not None:
        lines.append(
            f"feed: {100 * f['data_wait_frac']:.0f} % of step time waiting for data "
            f"({f['data_wait_s']:.3g} s of {f['step_s']:.3g} s per step)"
        )
    h = f["health"]
    lines += [textwrap.shorten(ln, 140) for ln in health_lines(f)]
    if h.get("memory"):
        m = h["memory"]
        lines.append(
            f"device memory {_fmt_n(m['used'], 'B')}" + (f" of {_fmt_n(m['limit'], 'B')}" if m.get("limit") else "")
        )
    y = 0.97
    for ln in lines:
        ax.text(0.0, y, ln, family="monospace", fontsize=8, va="top", transform=ax.transAxes)
        y -= 0.08
    for w in f["warnings"][:4]:
        ax.text(0.0, y, "! " + textwrap.shorten(w, 140), fontsize=8, va="top", color="#b45309", transform=ax.transAxes)
        y -= 0.08
    fig.suptitle(data["title"])
    return fig
