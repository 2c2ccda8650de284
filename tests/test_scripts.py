"""The two commands a new user runs: the demo must work end to end."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_script_runs():
    env = dict(os.environ, PYTHON=str(ROOT / ".venv" / "bin" / "python"))
    result = subprocess.run([str(ROOT / "scripts" / "demo.sh")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "packer pack → demo/packed" in result.stdout
    assert (ROOT / "demo" / "packed" / "metadata.json").is_file()
    assert "attention work" in result.stdout                     # inspect ran
    assert "verify: OK: demo/packed" in result.stdout + result.stderr  # verify --source passed
    assert "cu_seqlens_padded" in result.stdout and "qkv_format = thd" in result.stdout  # a batch loaded


def _lower_bounds_in_pyproject() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = ["):]
    block = block[:block.index("]")]
    bounds = {}
    for line in block.splitlines():
        line = line.split("#")[0].strip().strip(",").strip('"')
        if ">=" in line:
            name, rest = line.split(">=", 1)
            bounds[name.strip()] = rest.split(",")[0].strip()
    return bounds


def _pins_in_lowest() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "scripts" / "lowest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_lowest_versions_tested_are_the_ones_pyproject_accepts():
    """scripts/test_lowest.sh tests what pyproject.toml promises: every runtime dependency, each
    at its lower bound (or the first release at or above it, where no release is exactly it)."""
    bounds, pins = _lower_bounds_in_pyproject(), _pins_in_lowest()
    assert set(bounds) == set(pins), (bounds, pins)
    for name, bound in bounds.items():
        pinned, lowest = _release(pins[name]), _release(bound)
        assert lowest <= pinned and pinned[:2] == lowest[:2], (name, bound, pins[name])
