"""The planner never imports torch: every module of tenplex_megatron.plan (and the CLI, verify included) works with torch blocked.

A subprocess sets ``sys.modules['torch'] = None`` first, so any ``import torch``
(direct or through a dependency) raises ImportError; it then imports every
module found in the package with pkgutil and runs plan_reshard once.
"""

from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

CODE = r"""
import sys, pkgutil, importlib
sys.modules["torch"] = None  # any `import torch` now raises ImportError
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch was not blocked")
import tenplex_megatron.plan as plan
names = sorted(m.name for m in pkgutil.iter_modules(plan.__path__))
for required in ("layout", "ptc", "geometry", "planner", "writers", "data_position", "autolayout", "layout_files",
                 "trace", "json_pos", "simulate"):
    assert required in names, (required, names)
for n in names:
    importlib.import_module(f"tenplex_megatron.plan.{n}")
import tenplex_megatron.cli  # noqa: F401
import tenplex_megatron.cli_simulate  # noqa: F401
import tenplex_megatron.storage.files  # noqa: F401
import tenplex_megatron.storage.directory  # noqa: F401
import tenplex_megatron.storage.confine  # noqa: F401
import tenplex_megatron.storage.safetensors_header  # noqa: F401
import tenplex_megatron.storage.verify_ckpt  # noqa: F401
import tenplex_megatron.storage.megatron_ptc  # noqa: F401
import tenplex_megatron.storage.megatron_buckets  # noqa: F401
import tenplex_megatron.storage.megatron_torch_dist  # noqa: F401
import tenplex_megatron.storage.megatron_summary  # noqa: F401
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import layout_chunks, source_from_layout

# a hand-built PTC: a [4, 6] weight split in two along dim 1, re-sharded to one chunk
meta = {"w": TensorMeta("w", (4, 6), "float32", tp_axis=1)}
src = PTC(meta, (StoredChunk(Chunk("w", (0, 0), (4, 3)), Location("a", "w0", 0)),
                 StoredChunk(Chunk("w", (0, 3), (4, 3)), Location("b", "w1", 1))))
p = plan_reshard(src, meta, {0: [Chunk("w", (0, 0), (4, 6))]})
assert p.ranks[0].bytes_read == 4 * 6 * 4, p.ranks[0].bytes_read

# and a whole GPT through the layout model
t = gpt_tensors(GPTDims(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=30), 32)
src = source_from_layout(t, ParallelLayout(2, 1, 2), True)
p = plan_reshard(src, t, layout_chunks(t, ParallelLayout(1, 2, 1), True))
assert p.total_bytes_read > 0
# and a layout choice for a world size
from tenplex_megatron.plan.autolayout import choose_layout
from tenplex_megatron.plan.sim.gpt_catalogue import load_model
assert choose_layout(load_model("gpt3-1.3b"), 12, 4, 512, memory_gb=80).best.usable
loaded = [m for m, mod in sys.modules.items() if mod is not None and (m == "torch" or m.startswith("torch."))]
assert not loaded, loaded
print("OK", len(names))
"""


def test_plan_package_never_imports_torch() -> None:
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("OK")


def test_the_block_is_effective() -> None:
    """Control: the same harness does fail for a module that imports torch (storage.safetensors_io)."""
    code = 'import sys; sys.modules["torch"] = None\nimport tenplex_megatron.storage.safetensors_io\n'
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode != 0
    assert "import of torch halted" in p.stderr
