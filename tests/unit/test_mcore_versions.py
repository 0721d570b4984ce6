"""The supported megatron-core range (mcore_versions.py): declared once, refused clearly outside it, and the state
layout a checkpoint records checked against the installed version; the buffer arithmetic against megatron-core's own
where that release exposes it (0.19's optimizer/param_layout.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tenplex_megatron import mcore_versions as mv
from tenplex_megatron.plan.megatron_buffer import BufferParam, bucket_layout
from tests.harness import ROOT


def _version(text: str) -> mv.MegatronCoreVersion:
    return mv.MegatronCoreVersion(text, mv.parse(text), "test")


def test_pyproject_declares_the_supported_range() -> None:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    (mcore,) = [r for r in deps if r.name == "megatron-core"]
    assert mcore.specifier == SpecifierSet(mv.SUPPORTED)
    for text in mv.TESTED:
        assert mcore.specifier.contains(text) and mv.supported(mv.parse(text)), text
    for text in ("0.14.0", "0.20.0", "1.0.0"):
        assert not mcore.specifier.contains(text) and not mv.supported(mv.parse(text)), text


def test_installed_version_is_found_without_importing_megatron() -> None:
    code = ("import sys; from tenplex_megatron import mcore_versions as mv; v = mv.installed(); "
            "print(v.text, v.release, 'megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout.split()
    import megatron.core

    assert mv.parse(out[0]) == mv.parse(megatron.core.__version__)  # 0.19 appends the git commit of its folder
    assert out[-1] == "False"


@pytest.mark.parametrize("text", ["0.14.0", "0.20.0", "0.21.0rc1"])
def test_outside_the_range_is_one_clear_error(text: str) -> None:
    with pytest.raises(mv.UnsupportedMegatronCoreError) as e:
        mv.check_supported(_version(text))
    assert text in str(e.value) and mv.SUPPORTED in str(e.value)


def test_import_refuses_an_unsupported_megatron_core(tmp_path) -> None:
    """A megatron.core 0.14 first on sys.path: importing the trainer or the adapter fails at once, naming both
    versions, before any megatron-core module runs (its __init__ here would raise if it ran)."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise RuntimeError('megatron-core itself ran')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 14\nPATCH = 0\nPRE_RELEASE = ''\n")
    for module in ("tenplex_megatron.training.pretrain", "tenplex_megatron.integrations.megatron_core.adapter"):
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("tenplex_megatron.mcore_versions.UnsupportedMegatronCoreError"), r.stderr[-2000:]
        assert "0.14.0" in last and mv.SUPPORTED in last and "megatron-core itself ran" not in r.stderr


def test_every_supported_release_has_a_state_layout() -> None:
    for minor in range(mv.MIN[1], mv.BELOW[1]):
        assert mv.state_layout((0, minor, 0)) == mv.STATE_LAYOUT_V1
    assert mv.record(_version("0.19.0")) == {"version": "0.19.0", "state_layout": mv.STATE_LAYOUT_V1}


def test_a_checkpoint_naming_another_layout_is_refused_naming_both_versions() -> None:
    recorded = {"version": "0.21.0", "state_layout": "mcore-state-v2"}
    with pytest.raises(mv.StateLayoutError) as e:
        mv.check_checkpoint(recorded, "ckpt/iter_0000003/metadata.json", _version("0.19.0"))
    msg = str(e.value)
    assert "ckpt/iter_0000003/metadata.json" in msg and "0.21.0" in msg and "0.19.0" in msg
    assert "mcore-state-v2" in msg and mv.STATE_LAYOUT_V1 in msg
    # across supported versions (0.16.1 -> 0.19.0 and back), and a checkpoint that records none: accepted
    mv.check_checkpoint({"version": "0.16.1", "state_layout": mv.STATE_LAYOUT_V1}, "m", _version("0.19.0"))
    mv.check_checkpoint({"version": "0.19.0", "state_layout": mv.STATE_LAYOUT_V1}, "m", _version("0.15.3"))
    mv.check_checkpoint(None, "m", _version("0.19.0"))


@pytest.mark.mcore_layout_fn
def test_buffer_layout_equals_megatron_cores_own() -> None:
    """Where megatron-core exposes its buffer arithmetic (0.19: DistributedOptimizer._compute_per_buffer_param_layout,
    pure of process groups), plan/megatron_buffer.py's buckets equal it for shapes that exercise every rule. Run by
    make test-compat in its 0.19 venv (marker mcore_layout_fn); older versions compute the layout inside
    _ParamAndGradBuffer, where the adoption tests check it through megatron-core's own saved checkpoints."""
    import megatron.core
    from megatron.core.optimizer import distrib_optimizer as distrib

    compute = getattr(distrib.DistributedOptimizer, "_compute_per_buffer_param_layout", None)
    assert compute is not None, f"megatron-core {megatron.core.__version__} has no standalone layout function"
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    cases = [([100, 10], None, 2, False), ([300, 50], None, 3, False), ([64] * 4, 128, 1, False),
             ([1000, 7, 129, 4096, 33], 2000, 4, False), ([5000, 70], None, 8, True)]
    for numels, bucket_size, dp, busbw in cases:
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        params[0].shared_embedding = True  # the first: GPTModel's word embeddings, last in reverse order
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=busbw)
        theirs = compute(params, bucket_size, dp, cfg)
        ours = bucket_layout([BufferParam(f"p{i}", n, i == 0) for i, n in enumerate(numels)], dp, bucket_size, busbw)
        assert [b.numel for b in ours] == [e - s for s, e in theirs.bucket_indices], (numels, dp)
        assert [b.numel_unpadded for b in ours] == list(theirs.per_bucket_numel_unpadded), (numels, dp)
        starts = [s for s, _ in theirs.bucket_indices]
        for i, p in enumerate(params):
            start, end, bucket = theirs.param_index_map[p]
            (mine,) = [(s, e) for s, e in ((s, e) for n, s, e in ours[bucket].params if n == f"p{i}")]
            assert mine == (start - starts[bucket], end - starts[bucket]), (numels, dp, i)


def test_an_nvrx_older_than_megatron_core_0_17_1_asks_for_is_named_with_the_fix() -> None:
    """From 0.17.1 megatron-core's import asserts nvidia-resiliency-ext >= 0.6 when one is installed (core_v0.17.1,
    0.18.x and 0.19.0's dist_checkpointing/strategies/nvrx.py): the plugin names the mismatch (both versions, what to
    install) where it runs first; 0.17.0 with 0.4.1, or 0.18/0.19 with 0.6+, pass."""
    v019 = mv.MegatronCoreVersion("0.19.0", (0, 19, 0), "test")
    v018 = mv.MegatronCoreVersion("0.18.2", (0, 18, 2), "test")
    v0171 = mv.MegatronCoreVersion("0.17.1", (0, 17, 1), "test")
    v0170 = mv.MegatronCoreVersion("0.17.0", (0, 17, 0), "test")
    for v in (v019, v018, v0171):
        with pytest.raises(mv.NVRxMismatchError, match=rf"megatron-core {re.escape(v.text)} needs "
                           r"nvidia-resiliency-ext >= 0\.6 when one is installed; nvidia-resiliency-ext 0\.4\.1 is"):
            mv.check_nvrx(v, "0.4.1")
    mv.check_nvrx(v0170, "0.4.1")
    mv.check_nvrx(v018, "0.6.0")
    mv.check_nvrx(v019, "0.7.0")
