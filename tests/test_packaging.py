"""The three descriptions of the environment name the same pins."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def test_pyproject_environment_and_lock_agree():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pyproject = _pins(py["dependencies"] + [d for deps in py["optional-dependencies"].values() for d in deps])
    env_lines = [l.strip()[2:] for l in (ROOT / "environment.yml").read_text().splitlines() if l.strip().startswith("- ")]
    env = _pins(env_lines)
    lock = _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert {"torch", "torch-xla", "torchvision"} <= set(pyproject)
    assert pyproject["torch"] == "2.9.0" and pyproject["torch-xla"] == "2.9.0" and pyproject["torchvision"] == "0.24.0"
    assert env == pyproject, set(env.items()) ^ set(pyproject.items())
    mismatched = {k: (v, lock.get(k)) for k, v in pyproject.items() if lock.get(k) != v}
    assert not mismatched, f"requirements.txt disagrees with pyproject.toml: {mismatched}"
    assert "python=3.11" in (ROOT / "environment.yml").read_text()
