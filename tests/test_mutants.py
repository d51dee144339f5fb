"""bench/mutants.py (make mutants) stays plantable: every mutant's snippet is in its file once.

make mutants takes hours and runs by hand, so a snippet that a change rewrote would otherwise go
unnoticed until then, and the bug it stands for untested meanwhile."""

import importlib.util
import sys
from pathlib import Path

import pytest

from gptlab import kernels

ROOT = Path(__file__).resolve().parents[1]


def load_mutants():
    spec = importlib.util.spec_from_file_location("gptlab_mutants", ROOT / "bench" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


mutants = load_mutants()


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_can_be_planted(mutant):
    assert mutants.staleness(mutant) == ""
    assert mutant.new != mutant.old
    # a misspelt requirement would make the mutant n/a on every CPU, never run
    assert mutant.variant in ("", *kernels.VARIANTS) and mutant.feature in ("", *kernels.FEATURES)


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


def test_a_rewritten_snippet_is_found_stale(tmp_path):
    (tmp_path / "src" / "gptlab").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / "src" / "gptlab" / "x.py").write_text("a = 1\nb = 2\nb = 2\n")
    Mutant = mutants.Mutant
    assert mutants.staleness(Mutant("x/ok", "x.py", "a = 1", "a = 2", ("tests/test_x.py",)), tmp_path) == ""
    assert "found 0 times" in mutants.staleness(
        Mutant("x/moved", "x.py", "a = 3", "a = 2", ("tests/test_x.py",)), tmp_path
    )
    assert "found 2 times" in mutants.staleness(
        Mutant("x/twice", "x.py", "b = 2", "b = 3", ("tests/test_x.py",)), tmp_path
    )
    assert "does not exist" in mutants.staleness(
        Mutant("x/gone", "y.py", "a = 1", "a = 2", ("tests/test_x.py",)), tmp_path
    )
    assert "test_y.py" in mutants.staleness(
        Mutant("x/untested", "x.py", "a = 1", "a = 2", ("tests/test_y.py",)), tmp_path
    )
