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
