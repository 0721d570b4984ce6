"""The planner never imports torch: every module of tenplex_megatron.plan (and the CLI) works with torch blocked."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

CODE = r"""
import sys, pkgutil, importlib
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import tenplex_megatron.plan as plan
names = [m.name for m in pkgutil.iter_modules(plan.__path__)]
for n in names:
    importlib.import_module(f"tenplex_megatron.plan.{n}")
import tenplex_megatron.cli
from tenplex_megatron.plan.gpt_catalogue import GPTDims, gpt_tensors
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.shard_layout import layout_chunks, source_from_layout
t = gpt_tensors(GPTDims(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=30), 32)
src = source_from_layout(t, ParallelLayout(2, 1, 2), True)
plan = plan_reshard(src, t, layout_chunks(t, ParallelLayout(1, 2, 1), True))
assert plan.total_bytes_read > 0
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m == "torch"]
print("OK", len(names))
"""


def test_plan_package_never_imports_torch() -> None:
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("OK")
