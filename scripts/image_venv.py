"""Build (or reuse) a venv that stands in for a learner's image: Colab TPU/GPU, Kaggle TPU, a TorchTPU VM.

    python scripts/image_venv.py colab-tpu colab-gpu kaggle-tpu torchtpu-vm   # or --all; py3.13 = the lock on 3.13

Each image is a pin list in images/<name>.txt whose header names the source, the Python version,
the environment markers the image sets (`# env:`), what CI adds to run it on a CPU (`# run-env:`)
and what the notebooks' set-up cell should print there (`# expect:`). The venv is .venvs/<name>/,
made by uv with the image's Python. All venvs share one uv cache, ~/.cache/labkit-uv ($LABKIT_UV_CACHE), on the same
filesystem with hardlinks: a wheel is downloaded and unpacked once, and a file that two venvs share
(torch 2.9.0 for cp313 is in colab-tpu and py3.13) takes disk once (`du` counts hardlinks once).
A stamp (hash of the pin list and of this builder) makes a rerun a few tenths of a second; a venv
that a test changed (the set-up cell installs labkit) is put back with `uv pip sync`, from the cache.

Colab images also get a stand-in `google.colab` (Colab imports it when the kernel starts; the
notebooks only call `google.colab.auth.authenticate_user`, which here records the call and returns).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES_DIR = ROOT / "images"


def venvs_dir(root: Path) -> Path:
    """.venvs/ in the checkout, unless the checkout's path holds a space: torch's Inductor then cannot link what it
    compiles (torch 2.9 hands `-L<site-packages>/torch/lib` to the C++ compiler unquoted: "cannot find -ltorch"), so
    the venvs live in ~/.cache/labkit/venvs/<folder>-<hash of the path>/images/ and .venvs is a link to that folder
    (scripts/bootstrap.sh puts the project venv beside it, in .../venv)."""
    if not any(c.isspace() for c in str(root)):
        return root / ".venvs"
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:10]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "labkit" / "venvs" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', root.name)}-{tag}" / "images"


VENVS = venvs_dir(ROOT)
# outside the checkout, so every clone on a machine (and CI's fresh one) reuses the downloaded wheels;
# on the same filesystem as the venvs, uv hardlinks files from it instead of copying
CACHE = Path(os.environ.get("LABKIT_UV_CACHE") or Path.home() / ".cache" / "labkit-uv")
# bump when what the builder puts in a venv changes (the stand-in, the config files)
BUILDER_VERSION = "2"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass
class Image:
    name: str
    pin_file: Path
    python: str  # "3.13"
    pins: dict[str, str]  # normalised name -> version
    env: dict[str, str]  # markers the image itself sets
    run_env: dict[str, str]  # what CI adds to run it on a CPU
    expect: dict[str, str]  # what the set-up cell should print, e.g. {"platform": "colab-tpu", "choice": "keep"}
    colab: bool
    notebooks: tuple[str, ...] = ("01", "02")  # the notebooks CI runs in this image (their number prefixes)
    # notebooks run on several virtual XLA:CPU devices, as the image's chips: {"01": 2} (`# devices: 01=2 02=4`)
    devices: dict[str, int] = dataclasses.field(default_factory=dict)
    # notebooks run only up to the first code cell carrying a tag: {"01": "training"} (`# until: 01=training`)
    until: dict[str, str] = dataclasses.field(default_factory=dict)
    # notebooks that must end at their set-up cell, with its message and no traceback (`# stops: 00 03`): what they
    # need is not in the image (torch_xla in TorchTPU's image)
    stops: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def python_bin(self) -> Path:
        return self.venv / "bin" / "python"


def _pairs(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


def read_pins(path: Path) -> dict[str, str]:
    """The `name==version` lines of a pin list (comments and the header skipped), as {normalised name: version}."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}:{n}: expected 'name==version', got {line!r}")
        name = norm(m.group(1))
        if name in pins:
            raise ValueError(f"{path}:{n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


def load(name_or_path: str | Path) -> Image:
    """Read images/<name>.txt (or a path): header keys and `name==version` lines."""
    path = Path(name_or_path)
    if not path.suffix:
        path = IMAGES_DIR / f"{name_or_path}.txt"
    header: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*(python|env|run-env|expect|colab|notebooks|devices|until|stops):\s*(.*)$", line)
        if m:
            header[m.group(1)] = m.group(2).strip()
    if "python" not in header:
        raise ValueError(f"{path}: the header has no '# python: X.Y' line")
    img = Image(
        name=path.stem,
        pin_file=path,
        python=header["python"],
        pins=read_pins(path),
        env=_pairs(header.get("env", "")),
        run_env=_pairs(header.get("run-env", "")),
        expect=_pairs(header.get("expect", "")),
        colab="colab" in header,
        notebooks=tuple(header.get("notebooks", "01 02").split("(")[0].split()),  # "(why)" is a comment
        devices=_devices(path, header.get("devices", "").split("(")[0]),
        until=_pairs(header.get("until", "").split("(")[0]),
        stops=tuple(header.get("stops", "").split("(")[0].split()),
    )
    for key in ("devices", "until", "stops"):
        if stray := sorted(set(getattr(img, key)) - set(img.notebooks)):
            raise ValueError(f"{path}: '# {key}:' names notebook(s) {stray}, which '# notebooks:' does not run")
    return img


def _devices(path: Path, text: str) -> dict[str, int]:
    """`01=2 02=4` -> {"01": 2, "02": 4}; anything else is an error naming the file."""
    found = {}
    for item in text.split():
        m = re.fullmatch(r"(\d\d)=(\d+)", item)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"{path}: '# devices:' expects NOTEBOOK=COUNT pairs such as 01=2, got {item!r}")
        found[m.group(1)] = int(m.group(2))
    return found


def image_names() -> list[str]:
    return sorted(p.stem for p in IMAGES_DIR.glob("*.txt") if re.search(r"^#\s*expect:", p.read_text(), re.M))


def uv() -> list[str]:
    """uv from the project venv (pinned in requirements.txt), else from PATH."""
    for cand in (ROOT / ".venv" / "bin" / "uv", Path(sys.executable).parent / "uv"):
        if cand.exists():
            return [str(cand)]
    found = shutil.which("uv")
    if found:
        return [found]
    raise RuntimeError("uv not found: run `make venv` (it installs the pinned uv into .venv)")


def find_python(version: str) -> str:
    """An interpreter for X.Y: a pyenv install, else pythonX.Y on PATH that runs (no downloads)."""
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv"), "/root/.pyenv"]
    for root in filter(None, roots):
        hits = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
        if hits:
            return hits[-1]
    found = shutil.which(f"python{version}")  # a pyenv shim is on PATH even where it cannot run
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    raise RuntimeError(f"no Python {version} here: install python{version} (or pyenv install {version})")


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(UV_CACHE_DIR=str(CACHE), UV_LINK_MODE="hardlink", UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    # .pyc files written at install, as pip and the real images have them: without them, and with
    # PYTHONDONTWRITEBYTECODE set (as on CI machines), every kernel compiled torch's and torch_xla's sources again on
    # import (17 CPU-s against 4 for `import torch, torch_xla`); about 40 CPU-s and 0.3 GB once per venv
    env["UV_COMPILE_BYTECODE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, env=_uv_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def freeze(python: Path | str) -> dict[str, str]:
    """What is installed, as {normalised name: version} (uv's freeze: also lists pip and setuptools)."""
    out = _run([*uv(), "pip", "freeze", "--python", str(python)])
    pins = {}
    for line in out.splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            pins[norm(name)] = version.strip()
        elif " @ " in line:  # a path or URL install (labkit from the checkout)
            name, url = line.split(" @ ", 1)
            pins[norm(name)] = "@ " + url.strip()
    return pins


def expected_freeze(img: Image) -> dict[str, str]:
    want = dict(img.pins)
    if img.colab:
        want["google-colab"] = COLAB_VERSION
    return want


# ---- the stand-in google.colab ------------------------------------------------------------------
COLAB_VERSION = "1.0.0"  # the version Colab's own google-colab sdist has
_COLAB_INIT = '''"""Stand-in for Colab's google.colab, for CI runs of the notebooks (made by scripts/image_venv.py).

Only what the notebooks touch: importing it (Colab does so when the kernel starts) and
auth.authenticate_user(), which records the call and returns.
"""
from google.colab import auth  # noqa: F401

loaded_as_extension = False


def load_ipython_extension(ipython):
    global loaded_as_extension
    loaded_as_extension = True
'''
_COLAB_AUTH = '''"""Stand-in for google.colab.auth: no account in CI, calls are recorded."""
calls = []


def authenticate_user(*args, **kwargs):
    calls.append((args, kwargs))
'''


def _site_packages(venv: Path) -> Path:
    hits = list((venv / "lib").glob("python3.*/site-packages"))
    if len(hits) != 1:
        raise RuntimeError(f"{venv}: expected one site-packages folder, found {hits}")
    return hits[0]


def install_colab_stand_in(venv: Path) -> None:
    site = _site_packages(venv)
    pkg = site / "google" / "colab"  # a namespace package portion beside google.cloud, google.protobuf
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(_COLAB_INIT)
    (pkg / "auth.py").write_text(_COLAB_AUTH)
    # a dist-info, so `pip freeze` lists google-colab as it does in Colab and a test sees it survive
    info = site / f"google_colab-{COLAB_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: google-colab\nVersion: {COLAB_VERSION}\n")
    (info / "INSTALLER").write_text("labkit-image-venv\n")
    files = ["google/colab/__init__.py", "google/colab/auth.py"] + [
        f"{info.name}/{f}" for f in ("METADATA", "INSTALLER", "RECORD")
    ]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    # Colab's kernel imports google.colab at start-up; IPython reads <prefix>/etc/ipython/ for config
    etc = venv / "etc" / "ipython"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "ipython_kernel_config.py").write_text(
        "# Colab loads google.colab when the kernel starts (stand-in made by scripts/image_venv.py)\n"
        "c.InteractiveShellApp.extensions = ['google.colab']\n"
    )


# ---- building ---------------------------------------------------------------------------------
def _stamp(img: Image, requirement_files: list[Path]) -> str:
    h = hashlib.sha256(BUILDER_VERSION.encode() + img.python.encode())
    for f in requirement_files:
        h.update(f.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def _lock():
    VENVS.mkdir(parents=True, exist_ok=True)
    link = ROOT / ".venvs"
    if VENVS != link and not link.is_symlink() and not link.exists():
        link.symlink_to(VENVS, target_is_directory=True)
    with open(VENVS / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two test runs must not build the same venv at once
        yield


# GB a wheel takes unpacked in uv's cache, for the wheels over 0.1 GB (measured there with `du`, rounded up; torch 2.8
# to 2.11 on Linux x86-64, whose CUDA libraries come as nvidia-* wheels); any other wheel counts SMALL_GB, twice their
# average. On an empty cache that sums to 10.7 GB for colab-tpu, where the build took 9.0. A build needs what it must
# download and unpack, plus WARM_GB for what the venv holds of its own (folders, metadata and the .pyc files compiled
# at install, 0.3 GB): the files it shares with the cache are hardlinks and take no more disk. It is refused below
# that, by name, rather than failing half-way in uv with "No space left on device".
WHEEL_GB = {
    "torch": 1.8,
    "nvidia-cudnn-cu12": 1.1,
    "nvidia-cublas-cu12": 0.9,
    "triton": 0.7,
    "nvidia-cublas": 0.6,
    "nvidia-cudnn-cu13": 0.5,
    "nvidia-cusparselt-cu12": 0.45,
    "torch-xla": 0.45,
    "nvidia-nccl-cu12": 0.45,
    "nvidia-cusolver-cu12": 0.4,
    "nvidia-cusparse-cu12": 0.4,
    "libtpu": 0.5,  # 0.0.52 (torch-tpu's): 0.48 GB; 0.0.21.1 and 0.0.17 (torch_xla's) less
    "torch-tpu": 0.35,
    "nvidia-cufft": 0.3,
    "nvidia-cufft-cu12": 0.3,
    "nvidia-cusolver": 0.25,
    "nvidia-cusparselt-cu13": 0.25,
    "nvidia-cuda-nvrtc-cu12": 0.25,
    "nvidia-cuda-nvrtc": 0.25,
    "nvidia-nccl-cu13": 0.25,
    "nvidia-nvshmem-cu12": 0.2,
    "nvidia-cusparse": 0.2,
    "nvidia-curand-cu12": 0.15,
    "nvidia-curand": 0.15,
    "nvidia-nvjitlink": 0.1,
    "nvidia-nvjitlink-cu12": 0.1,
}
NVIDIA_GB = 0.1  # an nvidia-* wheel not listed (cupti, cuda-runtime, nvtx, cufile: 0.04 GB or less)
SMALL_GB = 0.01  # 0.005 on average, 120-odd of them per image
WARM_GB = 1.0


def uncached(python: str, pins: dict[str, str]) -> list[str]:
    """The pins whose wheel for this Python is not in uv's cache (what a build would download and unpack)."""
    ours = f"-cp{python.replace('.', '')}-"

    def fits(entry: str) -> bool:  # "2.9.0-cp313-cp313-manylinux_2_28_x86_64"; a hash for a wheel of several tags
        base = os.path.basename(entry)
        return os.path.isdir(entry) and (ours in base or "-abi3-" in base or not re.search(r"-cp3\d+-", base))

    missing = []
    for name, version in pins.items():
        entries = glob.glob(str(CACHE / "wheels-v*" / "pypi" / glob.escape(name) / f"{glob.escape(version)}-*"))
        if not any(fits(e) for e in entries):
            missing.append(f"{name}=={version}")
    return missing


def needs_gb(missing: list[str]) -> float:
    """GB free a build needs when these pins ("name==version") are not in uv's cache."""
    names = [m.split("==")[0] for m in missing]
    return WARM_GB + sum(WHEEL_GB.get(n, NVIDIA_GB if n.startswith("nvidia-") else SMALL_GB) for n in names)


def check_disk(img: Image) -> None:
    """Raise, naming the folder and the figures, when the disk holding .venvs/ has less free than the build needs:
    the wheels it must download and unpack into uv's cache, and WARM_GB for the venv's own files."""
    missing = uncached(img.python, img.pins)
    gb = needs_gb(missing)
    free = shutil.disk_usage(VENVS).free / 1e9
    if free < gb:
        big = sorted(missing, key=lambda m: -needs_gb([m]))
        what = f"{len(missing)} wheels to download ({', '.join(big[:3])}, ...)" if missing else "all wheels cached"
        raise RuntimeError(
            f"not enough disk to build the {img.name} venv in {VENVS}: {free:.1f} GB free, it needs about "
            f"{gb:.1f} GB ({what}; uv's cache {CACHE} shares files with it by hardlinks). Free some space."
        )


def build(img: Image, *, log=print) -> dict:
    """Create or reuse img.venv with exactly the pinned packages; returns what it did and how long it took."""
    t0 = time.perf_counter()
    with _lock():
        stamp_file = img.venv / ".image-stamp"
        stamp = _stamp(img, [img.pin_file])
        action = "reused"
        if not (img.python_bin.exists() and stamp_file.exists() and stamp_file.read_text() == stamp):
            action = "built"
            log(f"[image_venv] {img.name}: building {img.venv} with Python {img.python} from {img.pin_file.name}")
            if img.venv.exists():
                shutil.rmtree(img.venv)
            check_disk(img)
            _run([*uv(), "venv", "--quiet", "--python", find_python(img.python), str(img.venv)])
            _run([*uv(), "pip", "install", "--quiet", "--python", str(img.python_bin), "-r", str(img.pin_file)])
            if img.colab:
                install_colab_stand_in(img.venv)
            stamp_file.write_text(stamp)
        have = freeze(img.python_bin)
        if have != expected_freeze(img):
            # a previous run added labkit & co. (or changed a pin): put the image back, from the cache
            action = "restored" if action == "reused" else action
            _run([*uv(), "pip", "sync", "--quiet", "--python", str(img.python_bin), str(img.pin_file)])
            if img.colab:
                install_colab_stand_in(img.venv)
            have = freeze(img.python_bin)
        diff = {k: (v, have.get(k)) for k, v in expected_freeze(img).items() if have.get(k) != v}
        extra = sorted(set(have) - set(expected_freeze(img)))
        if diff or extra:
            raise RuntimeError(f"{img.venv} does not match {img.pin_file.name}: differs {diff}, not pinned {extra}")
    return {"name": img.name, "action": action, "seconds": time.perf_counter() - t0, "packages": len(have)}


# ---- the lock on another Python (the unit suite on 3.13) ----------------------------------------
def build_lock_venv(version: str, *, log=print) -> dict:
    """.venvs/py<version>/ from requirements.txt (the 3.11 lock) with Python <version>, same cache."""
    lock = ROOT / "requirements.txt"
    img = Image(name=f"py{version}", pin_file=lock, python=version, pins={}, env={}, run_env={}, expect={}, colab=False)
    t0 = time.perf_counter()
    with _lock():
        stamp_file = img.venv / ".image-stamp"
        stamp = _stamp(img, [lock])
        action = "reused"
        if not (img.python_bin.exists() and stamp_file.exists() and stamp_file.read_text() == stamp):
            action = "built"
            log(f"[image_venv] {img.name}: building {img.venv} with Python {version} from requirements.txt")
            if img.venv.exists():
                shutil.rmtree(img.venv)
            _run([*uv(), "venv", "--quiet", "--python", find_python(version), str(img.venv)])
            # --only-binary: a pin without a wheel for this Python fails here, by name, instead of compiling
            _run(
                [
                    *uv(),
                    "pip",
                    "install",
                    "--quiet",
                    "--only-binary",
                    ":all:",
                    "--python",
                    str(img.python_bin),
                    "-r",
                    str(lock),
                ]
            )
            stamp_file.write_text(stamp)
    return {"name": img.name, "action": action, "seconds": time.perf_counter() - t0, "python": str(img.python_bin)}


def disk_usage(paths: list[Path]) -> int:
    """Bytes on disk for these folders together; `du` counts a hardlinked file once."""
    out = subprocess.run(["du", "-sc", "--block-size=1", *map(str, paths)], capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"images ({', '.join(image_names())}) or pyX.Y (the lock on that Python)")
    ap.add_argument("--all", action="store_true", help="every image and py3.13")
    ap.add_argument("--du", action="store_true", help="print the disk the cache and venvs take")
    args = ap.parse_args()
    names = image_names() + ["py3.13"] if args.all else args.names
    results = []
    for name in names:
        r = build_lock_venv(name[2:]) if re.fullmatch(r"py3\.\d+", name) else build(load(name))
        print(f"[image_venv] {r['name']}: {r['action']} in {r['seconds']:.1f} s", flush=True)
        results.append(r)
    if args.du:
        parts = [p for p in [CACHE, *(VENVS / n for n in names)] if p.exists()]
        sizes = {p.name: disk_usage([p]) for p in parts}
        total = disk_usage(parts)
        print(json.dumps({"bytes_each_alone": sizes, "bytes_together": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
