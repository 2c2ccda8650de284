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


def _script_copy(tmp_path: Path, *names: str) -> Path:
    """A clone's scripts and pyproject.toml under ``tmp_path/clone`` (physical path)."""
    root = tmp_path.resolve() / "clone"
    (root / "scripts").mkdir(parents=True)
    for name in names:
        (root / "scripts" / name).write_bytes((ROOT / "scripts" / name).read_bytes())
        (root / "scripts" / name).chmod(0o755)
    (root / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    return root


def _run_script(root: Path, command: str) -> subprocess.CompletedProcess:
    # PYTHON=false: a venv that is to be made again fails at once, after the old one is removed
    env = dict(os.environ, PYTHON="false")
    return subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("recorded, kept", [("self", True), ("/elsewhere/clone", False)])
def test_lowest_venv_is_made_again_in_a_copied_clone(tmp_path, recorded, kept):
    """.venv-lowest copied with its clone would test the original clone's code (an editable
    install points there): it is kept only where it was made."""
    root = _script_copy(tmp_path, "test_lowest.sh", "lowest.txt")
    venv = root / ".venv-lowest"
    venv.mkdir()
    (venv / "marker").touch()
    stamp = venv / ".packer-lowest"
    stamp.write_text(str(root) if recorded == "self" else recorded)
    os.utime(stamp, (2**31, 2**31))  # newer than the files it watches
    result = _run_script(root, "scripts/test_lowest.sh")
    assert (venv / "marker").exists() == kept, result.stderr
    assert result.returncode != 0  # kept: no python in it to run; made again: PYTHON=false


@pytest.mark.parametrize("recorded, kept", [("self", True), ("/elsewhere/clone", False)])
def test_venv_is_made_again_in_a_copied_clone(tmp_path, recorded, kept):
    root = _script_copy(tmp_path, "_venv.sh")
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(os.sys.executable))
    (venv / ".packer-root").write_text(str(root) if recorded == "self" else recorded)
    (venv / ".packer-extra-dev").touch()
    os.utime(venv / ".packer-extra-dev", (2**31, 2**31))
    result = _run_script(root, "source scripts/_venv.sh dev")
    assert (venv / "bin" / "python").exists() == kept, result.stderr
    assert (result.returncode == 0) == kept
    if not kept:
        assert "was made for another directory" in result.stderr
