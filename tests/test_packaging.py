"""Packaging: pyproject.toml states ranges; the lock (requirements.txt), environment.yml and every learner
image (images/*.txt) satisfy them, so installing labkit in an image changes none of its packages."""

import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
IMAGES = sorted((ROOT / "images").glob("*.txt"))


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].split(";")[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s]+)", line)
        if m:
            out[_norm(m.group(1))] = m.group(2)
    return out


LOCK = _pins((ROOT / "requirements.txt").read_text().splitlines())
CORE = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["optional-dependencies"].items()}
# `bench`: the frameworks bench/bench_peers.py compares labkit with; they live in a venv of their own,
# never in the project's lock (labkit must not depend on them, even by accident)
LOCKED_EXTRAS = {name: reqs for name, reqs in EXTRAS.items() if name != "bench"}


def _unsatisfied(reqs, pins, *, missing_ok=False):
    bad = {}
    for req in reqs:
        have = pins.get(_norm(req.name))
        if have is None:
            if not missing_ok:
                bad[req.name] = (str(req.specifier), "missing")
        elif not req.specifier.contains(have, prereleases=True):
            bad[req.name] = (str(req.specifier), have)
    return bad


def test_dependencies_are_ranges_not_pins():
    pinned = [str(r) for r in CORE + EXTRAS["xla"] if any(s.operator == "==" for s in r.specifier)]
    assert not pinned, f"pyproject.toml pins {pinned}: users need ranges (the exact lock is requirements.txt)"
    names = {_norm(r.name) for r in CORE}
    assert {"torch", "torchvision", "numpy", "webdataset", "google-cloud-storage", "ipywidgets"} <= names
    xla = EXTRAS["xla"][0]
    assert _norm(xla.name) == "torch-xla" and xla.specifier.contains("2.8.0") and xla.specifier.contains("2.9.0")
    assert not xla.specifier.contains("2.10.0"), "torch_xla 2.9 is the last release; a future one is untested"
    rp = PROJECT["requires-python"]
    assert all(Requirement(f"x{rp}").specifier.contains(v) for v in ("3.10", "3.11", "3.12", "3.13"))


def test_distribution_name_is_free_and_import_name_is_labkit():
    # "labkit" on PyPI is someone else's package (0.0.3.dev11, 2015): `pip install labkit` would get it
    assert _norm(PROJECT["name"]) != "labkit"
    assert _norm(PROJECT["name"]).startswith("labkit-")
    assert (ROOT / "labkit" / "__init__.py").exists()


def test_lock_satisfies_the_ranges():
    bad = _unsatisfied(CORE + [r for reqs in LOCKED_EXTRAS.values() for r in reqs], LOCK)
    assert not bad, f"requirements.txt does not satisfy pyproject.toml: {bad}"
    assert "uv" in LOCK, "uv (image venvs, the 3.13 suite) must be in the lock"


def test_bench_peers_stay_out_of_the_lock():
    peers = {_norm(r.name) for r in EXTRAS["bench"]}
    assert peers == {"lightning-fabric", "accelerate"}
    assert not peers & set(LOCK), f"requirements.txt locks {sorted(peers & set(LOCK))}: a peer became a dependency"


def test_range_check_can_fail():
    assert _unsatisfied([Requirement("torch>=2.8")], {"torch": "2.7.1"}) == {"torch": (">=2.8", "2.7.1")}
    assert _unsatisfied([Requirement("ipywidgets>=7.6")], {}) == {"ipywidgets": (">=7.6", "missing")}


def test_environment_yml_names_the_lock_versions():
    text = (ROOT / "environment.yml").read_text()
    env = _pins(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- "))
    wrong = {k: (v, LOCK.get(k)) for k, v in env.items() if LOCK.get(k) != v}
    assert not wrong, f"environment.yml disagrees with requirements.txt: {wrong}"
    named = {_norm(r.name) for r in CORE + [r for reqs in LOCKED_EXTRAS.values() for r in reqs]}
    assert not named - set(env), f"environment.yml lacks {sorted(named - set(env))}"
    assert "python=3.11" in text


@pytest.mark.parametrize("path", IMAGES, ids=[p.stem for p in IMAGES])
def test_every_image_satisfies_the_ranges(path):
    """What an image has already is inside the ranges: pip keeps it (missing packages only get added)."""
    pins = _pins(path.read_text().splitlines())
    assert len(pins) > 50, f"{path.name}: too few pins to be an image"
    assert "torch" in pins and "ipykernel" in pins
    bad = _unsatisfied(CORE, pins, missing_ok=True)
    if "torch-xla" in pins:
        bad |= _unsatisfied(EXTRAS["xla"], pins)
        assert pins["torch-xla"].split(".")[:2] == pins["torch"].split(".")[:2], "torch_xla needs its own torch"
    assert not bad, f"{path.name} has versions outside pyproject.toml's ranges: {bad}"
    assert re.search(r"^# python: 3\.1[0-3]$", path.read_text(), re.M), f"{path.name}: header names no Python"


def test_images_cover_the_learner_platforms():
    assert {p.stem for p in IMAGES} >= {"colab-tpu", "colab-gpu", "kaggle-tpu", "torchtpu-vm"}
