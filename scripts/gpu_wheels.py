"""Prepare the wheels a lent NVIDIA machine lacks, as the device tool's README says, into .gpu_wheels/ (ignored).

    python scripts/gpu_wheels.py            # download what is missing, then check the folder
    python scripts/gpu_wheels.py --check    # check only (the dry run of scripts/gpu_check.sh does this)

The device's Python is 3.12 with torch 2.11 and no network (images/device/nvidia-cuda.txt lists what it has);
what labkit, its notebooks and the notebook driver need beyond that is images/device/carry.txt. Each line there is
one `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp` with the manylinux
platforms below (pip matches manylinux_2_N's N exactly, so every N is named). Then the folder is checked:
- one wheel per carried package, at its pinned version, and nothing else (two versions stop the whole install);
- every Requires-Dist of every wheel (markers evaluated for CPython 3.12 on Linux x86_64, no extras) is carried or
  is on the device, at a version its specifier admits (`--no-deps` fetches none of them: each is named);
- the folder fits the device tool's 64 MiB for all that travels, with room left for the checkout (WHEELS_MAX_MB).
Any failure names the package. On the device: `run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"])`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

# run as a script (python scripts/gpu_wheels.py): scripts/ is on the path, so its sibling's pin reader is one import
from image_venv import read_pins
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / "images" / "device" / "carry.txt"
DEVICE = ROOT / "images" / "device" / "nvidia-cuda.txt"
OUT = ROOT / ".gpu_wheels"
PYTHON = "3.12"
# manylinux_2_17 .. 2_35 and the old aliases: what a glibc 2.35+ machine runs (the device's Python 3.12.3 is Ubuntu
# 24.04's, glibc 2.39, not recorded there: 2.35 keeps a margin); 2_36..2_39 are tried only when nothing older fits
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 36)
]
LATER_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(36, 40)]
WHEELS_MAX_MB = 40  # of the 64 MiB a device call carries: the checkout itself is the rest


def target_environment() -> dict[str, str]:
    """Marker values of the device's interpreter (CPython 3.12 on Linux x86_64), whatever runs this script."""
    env = default_environment()
    env.update(
        python_version=PYTHON,
        python_full_version=f"{PYTHON}.3",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_version=f"{PYTHON}.3",
        extra="",
    )
    return env


def wheels(folder: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for f in sorted(folder.glob("*.whl")):
        name, _, _, _ = parse_wheel_filename(f.name)
        found.setdefault(canonicalize_name(name), []).append(f)
    return found


def download(name: str, version: str, out: Path, log=print) -> None:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON]
    base += ["--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(out), "-q"]
    for platforms in (PLATFORMS, PLATFORMS + LATER_PLATFORMS):
        cmd = base + [a for p in platforms for a in ("--platform", p)] + [f"{name}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            if platforms is not PLATFORMS:
                log(f"[gpu_wheels] {name}=={version}: only a manylinux_2_36+ wheel (needs glibc >= 2.36 there)")
            return
    raise RuntimeError(f"no CPython {PYTHON} manylinux x86_64 wheel of {name}=={version}:\n{proc.stderr[-2000:]}")


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())
    env = target_environment()
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def check(folder: Path, carry: dict[str, str], device: dict[str, str]) -> list[str]:
    """What is wrong with the folder, one line per problem (empty: ready to carry)."""
    problems = []
    found = wheels(folder)
    for name, files in found.items():
        if len(files) > 1:
            problems.append(f"{name}: {len(files)} wheels ({', '.join(f.name for f in files)}): keep one")
        if name not in carry:
            problems.append(f"{files[0].name}: not in {CARRY.name} (remove it)")
        elif parse_wheel_filename(files[0].name)[1] != Version(carry[name]):
            problems.append(f"{files[0].name}: {CARRY.name} pins {name}=={carry[name]}")
        if name in device:
            problems.append(f"{name}: the device has it ({DEVICE.name}): carrying a second copy shadows it")
    for name in carry:
        if name not in found:
            problems.append(f"{name}=={carry[name]}: no wheel in {folder} (run scripts/gpu_wheels.py)")
    for name, files in found.items():
        for req in requires(files[0]):
            dep = canonicalize_name(req.name)
            have = carry.get(dep) or device.get(dep)
            if have is None:
                problems.append(f"{name} needs {req}: neither carried ({CARRY.name}) nor on the device ({DEVICE.name})")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                where = "carried" if dep in carry else "the device's"
                problems.append(f"{name} needs {req}, {where} is {dep}=={have}")
    size = sum(f.stat().st_size for fs in found.values() for f in fs) / 2**20
    if size > WHEELS_MAX_MB:
        problems.append(f"{folder}: {size:.1f} MiB of wheels, over {WHEELS_MAX_MB} MiB (the device carries 64 in all)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="only check the folder; download nothing")
    a = ap.parse_args(argv)
    carry, device = read_pins(CARRY), read_pins(DEVICE)
    a.out.mkdir(exist_ok=True)
    if not a.check:
        have = wheels(a.out)
        for name, version in carry.items():
            if any(parse_wheel_filename(f.name)[1] == Version(version) for f in have.get(name, [])):
                continue
            download(name, version, a.out)
            print(f"[gpu_wheels] downloaded {name}=={version}", flush=True)
        for name, files in wheels(a.out).items():  # wheels of versions no longer pinned
            for f in files:
                if name not in carry or parse_wheel_filename(f.name)[1] != Version(carry[name]):
                    f.unlink()
                    print(f"[gpu_wheels] removed {f.name} (not pinned)")
    problems = check(a.out, carry, device)
    size = sum(f.stat().st_size for f in a.out.glob("*.whl")) / 2**20
    if problems:
        print("[gpu_wheels] NOT READY:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"[gpu_wheels] ready: {len(carry)} wheels, {size:.1f} MiB in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
