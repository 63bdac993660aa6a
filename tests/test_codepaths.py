"""'Is this labkit's code?' is decided by the package's resolved folder, not by a substring of a path: in a clone
named `labkit` (what `git clone .../labkit` makes) or under a Colab Drive folder with a space, the learner's code and
the tests are still theirs."""

import os

import pytest

import labkit
from labkit.codepaths import LABKIT_DIR, is_labkit_file, under
from labkit.lessons import exercises
from tests.helpers import child_env


def _raise_from(path, tmp_path):
    """An exception raised by code whose file is `path` (written there, compiled with that name)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = "def learner():\n    x = 1\n    return x / 0\n"
    with open(path, "w") as f:
        f.write(src)
    ns = {}
    exec(compile(src, path, "exec"), ns)
    try:
        ns["learner"]()
    except ZeroDivisionError as e:
        return e
    raise AssertionError("no exception")


@pytest.mark.parametrize("folders", [("labkit", "labkit", "tests"), ("content", "drive", "My Drive", "labkit")])
def test_a_learners_file_in_a_folder_named_labkit_is_the_learners(tmp_path, folders):
    path = os.path.join(tmp_path, *folders, "my_solution.py")
    assert not is_labkit_file(path)
    e = _raise_from(path, tmp_path)
    said = exercises._raised(e)
    assert "(at my_solution.py:3)" in said, said


def test_labkits_own_files_are_its_own_and_a_longer_sibling_is_not(tmp_path):
    assert is_labkit_file(labkit.__file__) and is_labkit_file(os.path.join(LABKIT_DIR, "loop.py"))
    assert not is_labkit_file(LABKIT_DIR + "_extra" + os.sep + "loop.py")  # /x/labkit_extra is not /x/labkit
    assert not is_labkit_file("<ipython-input-3-abc>") and not is_labkit_file("")
    # a symlink to the package resolves to it
    link = tmp_path / "lk"
    link.symlink_to(LABKIT_DIR, target_is_directory=True)
    assert is_labkit_file(str(link / "loop.py"))
    assert under(str(tmp_path / "a b" / "c.py"), str(tmp_path / "a b")) and not under(
        str(tmp_path / "a bc"), str(tmp_path / "a b")
    )


@pytest.mark.heavy  # a child pytest of ~30 s; the 3.13 run leaves it to the 3.11 run
def test_the_checkers_tests_pass_in_a_clone_named_labkit_under_a_folder_with_a_space(tmp_path):
    """What `git clone .../labkit` into a Colab Drive folder gives: the package and the tests in
    '.../My Drive/labkit/'. The tests that read where a learner's code raised run there, on that copy."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    clone = tmp_path / "My Drive" / "labkit"
    for part in ("labkit", "tests", "data_tools", "notebooks", "scripts", "pyproject.toml"):
        src = root / part
        if src.is_dir():
            shutil.copytree(src, clone / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, clone / part)
    env = child_env(clone)
    where = subprocess.run(
        [sys.executable, "-c", "import labkit, tests; print(labkit.__file__); print(tests.__file__)"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.stdout.splitlines() == [str(clone / "labkit" / "__init__.py"), str(clone / "tests" / "__init__.py")], (
        where.stdout + where.stderr
    )
    tests = ["tests/test_exercises.py", "tests/test_codepaths.py", "tests/test_exercises_nb01.py"]
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-m", "not heavy"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "failed" not in p.stdout.splitlines()[-1], p.stdout[-2000:]
