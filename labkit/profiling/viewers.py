"""A capture in the tools people use, and what XLA's top fusions fused.

    print(labkit.profiling.viewers.how_to_open(a.folder))       # TensorBoard/XProf, Perfetto, on Colab too
    path = labkit.profiling.viewers.chrome_trace(a.folder)      # a plain trace.json for ui.perfetto.dev
    labkit.profiling.viewers.dump_optimized_hlo(folder)         # before torch_xla starts: XLA writes its HLO
    labkit.profiling.viewers.fused_ops(folder, a.op_events[0])  # ['multiply', 'erf', ...] for a fusion

Viewers. On XLA the capture folder holds `plugins/profile/<run>/<host>.xplane.pb`, the layout TensorBoard's
profile plugin (XProf) reads: `tensorboard --logdir <folder>`, tab "Profile" (trace viewer, op profile, memory).
The plugin is the package `xprof` (`tensorboard-plugin-profile` 2.22 only depends on the xprof of its own version;
`xprof --logdir DIR` also serves without TensorBoard). Colab's TPU image has no tensorboard at all (its 2026-08
manifest): install `tensorboard xprof`; neither depends on torch, and the constraints file `how_to_open` writes pins
torch, torch_xla, numpy and protobuf where they are, so pip can only add. Proved with `pip install --dry-run
--python-version 3.13 --only-binary=:all:` against images/colab-tpu.txt as constraints (2026-11-26): it resolves
to tensorboard 2.21.0 and xprof 2.22.3, with the image's protobuf 7.35.1 and setuptools 75.2.0 unmoved (tensorboard
2.21 needs protobuf >= 6.31.1). Where the installed protobuf is older (protobuf 5.29.5 pinned), pip falls back to
tensorboard 2.20.0. Not run on Colab here. Off XLA the capture is torch.profiler's Chrome trace `trace.json`, which
ui.perfetto.dev and chrome://tracing open; `chrome_trace` writes the XLA capture's events as the same plain JSON.

Fusions. XLA names each instruction of a compiled graph once (`fusion.3`, `dot.12`, `multiply_erf_fusion`); a
fusion instruction calls its own fused computation, whose ops are only in the optimized HLO. With
`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text` set before torch_xla starts, XLA writes each compiled module
as `module_NNNN.<name>.<backend>_after_optimizations.txt`; a trace event's `hlo_module` names the module, and
`fused_ops` reads the fused computation that instruction calls. A graph taken from the persistent compile cache
is not compiled again, so it is not dumped either: then `fused_ops` returns None.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from labkit.envsetup import notebook_line, shell_words

PINNED = ("torch", "torch_xla", "numpy", "protobuf")  # what installing the viewers must not move
# ops that only lay out or make up values: left out of a fusion's summary unless asked for (all=True)
LAYOUT = frozenset({"parameter", "constant", "broadcast", "iota", "bitcast", "reshape", "tuple", "get-tuple-element"})


def dump_optimized_hlo(dump_dir) -> bool:
    """Ask XLA to write every compiled module's optimized HLO as text to dump_dir. Works only before torch_xla
    starts (XLA reads XLA_FLAGS once): returns whether the flag is in place for this process."""
    flag = f"--xla_dump_to={dump_dir}"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag in flags:
        return True
    if "torch_xla" in sys.modules:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {flag} --xla_dump_hlo_as_text".strip()
    return True


def _fusion_call(text: str, instruction: str) -> str | None:
    m = re.search(rf"^\s*(?:ROOT\s+)?%{re.escape(instruction)} = .*\bcalls=%([\w.\-]+)", text, re.M)
    return m.group(1) if m else None


def _computation_ops(text: str, computation: str, every: bool) -> list[str]:
    lines = text.splitlines()
    head = re.compile(rf"^\s*%?{re.escape(computation)}\s.*\{{\s*$")
    for i, line in enumerate(lines):
        if head.match(line):
            ops = []
            for body in lines[i + 1 :]:
                if body.strip() == "}":
                    break
                m = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = \S+(?: \S+)*? ([a-z][\w\-]*)\(", body)
                if m and (every or m.group(1) not in LAYOUT) and m.group(1) != "parameter":
                    ops.append(m.group(1))
            return ops
    return []


def fused_ops(dump_dir, event: dict, every: bool = False) -> list[str] | None:
    """The ops (HLO opcodes, in order) of the fused computation that one op execution's instruction calls, read
    from the optimized HLO dumped for its module; constants, broadcasts and other layout ops left out unless
    every=True. [] for an instruction that is not a fusion; None where the module's dump is missing (no
    XLA_FLAGS before torch_xla started, a graph from the compile cache, a backend without modules)."""
    module, name = event.get("module"), event.get("name")
    if not module or not name:
        return None
    files = sorted(glob.glob(os.path.join(str(dump_dir), f"*.{module}.*after_optimizations.txt")), key=os.path.getmtime)
    if not files:
        return None
    text = Path(files[-1]).read_text()
    called = _fusion_call(text, name)
    return _computation_ops(text, called, every) if called else []


def chrome_trace(folder) -> Path:
    """A plain (uncompressed) Chrome trace JSON of a capture, for ui.perfetto.dev or chrome://tracing: torch's
    own `trace.json` off XLA, else the XLA capture's `.trace.json.gz` written out as `trace.json`."""
    folder = Path(folder)
    out = folder / "trace.json"
    if out.exists():
        return out
    gz = sorted(folder.glob("plugins/profile/*/*.trace.json.gz"))
    if not gz:
        raise FileNotFoundError(f"{folder}: no trace to export (plugins/profile/*/*.trace.json.gz or trace.json)")
    with gzip.open(gz[-1], "rt") as f:
        data = json.load(f)
    out.write_text(json.dumps(data))
    return out


def _pins() -> list[str]:
    out = []
    for dist in PINNED:
        try:
            out.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return out


def how_to_open(folder, colab: bool | None = None) -> str:
    """What to type to open a capture in TensorBoard/XProf or Perfetto, here (a shell, Jupyter or Colab). Writes
    the constraints file it names (the installed torch, torch_xla, numpy and protobuf) beside the capture."""
    folder = Path(folder).resolve()
    colab = "google.colab" in sys.modules if colab is None else colab
    xplane = sorted(folder.glob("plugins/profile/*/*.xplane.pb"))
    keep = folder / "keep-installed.txt"
    keep.write_text("\n".join(_pins()) + "\n")
    # every path quoted (shlex.quote): a Drive folder holds spaces, a run may be named anything
    install = shell_words("pip", "install", "tensorboard", "xprof", "-c", keep)
    board = shell_words("tensorboard", "--logdir", folder)
    lines = []
    if xplane:
        lines.append(f"TensorBoard / XProf (the profile plugin reads {xplane[-1].relative_to(folder)}):")
        if colab:
            lines += [f"  {notebook_line(install)}   # Colab's TPU image has no tensorboard", "  %load_ext tensorboard",
                      f"  {notebook_line(board, '%')}"]  # fmt: skip
        else:
            lines += [f"  {install}", f"  {board}   # then the 'Profile' tab"]
    trace = folder / "trace.json"
    lines.append(
        "Perfetto: open ui.perfetto.dev and drop "
        + (f"{trace}" if trace.exists() else f"the file labkit.profiling.viewers.chrome_trace({str(folder)!r}) writes")
        + (" (on Colab: download it first, files.download)" if colab else "")
    )
    return "\n".join(lines)
