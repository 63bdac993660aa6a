"""'Is this labkit's code?' is decided by the package's resolved folder, not by a substring of a path: in a clone
named `labkit` (what `git clone .../labkit` makes) or under a Colab Drive folder with a space, the learner's code and
the tests are still theirs."""

import os

import pytest

import labkit
from labkit.codepaths import LABKIT_DIR, is_labkit_file, under
from labkit.lessons import exercises


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
