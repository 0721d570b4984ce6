"""The CPU shim (``training/cpu_shim.py``) installs once per process, and the patched torch keeps that it is patched
(a mark on the stand-in it installs), not the shim's module. In a fresh interpreter: the shim stays installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
from megatron.core.pipeline_parallel import schedules
from tenplex_megatron.training import cpu_shim
before = cpu_shim.installed()
cpu_shim.install()
wrapped = schedules.deallocate_output_tensor
cpu_shim.install()
print(before, cpu_shim.installed(), schedules.deallocate_output_tensor is wrapped)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim refuses a GPU machine")
def test_install_is_once_per_process() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.stdout.split() == ["False", "True", "True"], out.stderr[-2000:]
