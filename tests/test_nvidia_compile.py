"""Every Triton kernel of the NVIDIA plugin compiles for the H200 (SM90), on any machine
(``deepinfer_nvidia.compile_check``, in a fresh interpreter: the test session runs Triton interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]  # the plugin importable whether or not it is pip-installed
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "backends" / "nvidia"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "deepinfer_nvidia.compile_check"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") >= 11
