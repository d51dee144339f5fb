"""pyproject.toml's floors hold: the torch floor is at least what every torch API the source uses
needs, and a Python floor below 3.11 comes with tomli (tomllib is 3.11's).

A CI job on the minimum torch would be stronger; offline it is not cheap (download.pytorch.org is
unreachable here and PyPI's Linux torch 2.6.0 wheel is the CUDA build, ~770 MB plus NVIDIA wheels),
so this table is the check. Add a row when code starts using a newer torch API.
"""

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# A regular expression over the source -> the first torch release where that API is public.
TORCH_APIS = {
    r"from torch\.distributed\.fsdp import fully_shard": "2.6",  # FSDP2, public in torch.distributed.fsdp
    r"nn\.RMSNorm\(": "2.4",
    r"torch\.compiler\.is_compiling\(": "2.3",
    r"torch\.amp\.GradScaler\(": "2.3",
    r"torch\.distributed\.checkpoint\.state_dict": "2.2",
    r"weights_only=True": "1.13",
    r"scaled_dot_product_attention\(": "2.0",
}


def source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "src" / "gptlab").rglob("*.py")))


def requirement(name: str) -> Requirement:
    for spec in PYPROJECT["project"]["dependencies"]:
        req = Requirement(spec)
        if req.name == name:
            return req
    raise AssertionError(f"{name} is not a dependency")


def floor(specifier: SpecifierSet) -> Version:
    lows = [Version(s.version) for s in specifier if s.operator in (">=", "==", "~=")]
    assert lows, f"no lower bound in {specifier}"
    return max(lows)


def test_the_torch_floor_covers_every_torch_api_used():
    code, torch_floor = source(), floor(requirement("torch").specifier)
    used = {pattern: Version(v) for pattern, v in TORCH_APIS.items() if re.search(pattern, code)}
    assert used, "none of the APIs in the table is used: the table is stale"
    needed = max(used.values())
    assert torch_floor >= needed, f"torch>={torch_floor}, but the source uses APIs from torch {needed}: " + ", ".join(
        p for p, v in used.items() if v > torch_floor
    )


def test_python_below_3_11_gets_tomli_for_the_toml_configs():
    python_floor = floor(SpecifierSet(PYPROJECT["project"]["requires-python"]))
    if python_floor >= Version("3.11"):
        return  # tomllib is in the standard library
    assert "import tomli" in source()
    tomli = requirement("tomli")
    assert tomli.marker is not None and tomli.marker.evaluate({"python_version": "3.10"})
    assert not tomli.marker.evaluate({"python_version": "3.11"})  # not installed where tomllib exists


def test_torch_spec_passes_pip_an_index_as_the_readme_shows(tmp_path):
    """README: `make test TORCH_SPEC="torch==2.13.0 --index-url ..."` picks a build. The Makefile
    quoted TORCH_SPEC into one argument, which pip refused as an invalid requirement."""
    import shlex
    import subprocess

    venv = tmp_path / "venv"
    spec = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    done = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", f"TORCH_SPEC={spec}",
                           f"{venv}/.installed-core"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "index-url" in line)
    pip = line.split("&", 1)[1].split(";", 1)[0]  # kernel_build.py & PIP; status=...
    assert shlex.split(pip)[-5:] == ["install", "-q", *shlex.split(spec)], pip
