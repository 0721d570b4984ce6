"""Which megatron-core releases the plugin supports, and the version-specific layouts it reads, keyed by version.

Pure (no torch, no megatron import): the version is read from the ``package_info.py`` of the ``megatron.core``
that ``import megatron.core`` would load (an installed wheel, or a Megatron-LM checkout first on ``sys.path``), so
an unsupported one is refused with one clear error before any of its modules run. What differs between releases
and what the plugin depends on is named by a *state layout* id per release line (``STATE_LAYOUTS``); a checkpoint
records the id it was written with, and a job whose megatron-core cannot reproduce that id refuses it, naming both
versions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tenplex_megatron.errors import TenplexError

#: The supported range, as pyproject.toml declares it (tests/unit/test_mcore_versions.py keeps the two in step):
#: every release line from MIN up to, not including, BELOW.
MIN = (0, 15)
BELOW = (0, 20)
SUPPORTED = ">=0.15,<0.20"
#: The release lines `make test` (the pinned set) and `make test-compat` (0.15.3 and 0.19.0) run.
TESTED = ("0.15.3", "0.16.1", "0.19.0")

#: The layout every supported release line writes and reads, one id for all of 0.15-0.19 (checked against each):
#: - the sharded-state-dict keys of GPTModel (``embedding.word_embeddings.weight``, ``decoder.layers.N....``,
#:   ``output_layer.weight``) and the optimizer's (``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>``);
#: - the distributed optimizer's grad buffer (``plan/megatron_buffer.py``): parameters in reverse order, each
#:   starting at a multiple of 64 elements, the shared embedding in a bucket of its own, bucket ends padded to
#:   lcm(DP, 128) (lcm(DP, 128, 2^16) with ``pad_buckets_for_high_nccl_busbw``), dp_reshardable's pieces
#:   (gaps saved, end padding not), torch_dist keys ``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_D.
#:   bucket_idx_K``; 0.19 moved the arithmetic into ``optimizer/param_layout.py`` without changing it;
#: - Adam's state (``exp_avg``, ``exp_avg_sq``, a per-group ``step``) and the fp32 main weights of 16-bit params.
STATE_LAYOUT_V1 = "mcore-state-v1"
STATE_LAYOUTS: Mapping[str, tuple[tuple[int, int], tuple[int, int]]] = MappingProxyType(
    {STATE_LAYOUT_V1: ((0, 15), (0, 20))})


class UnsupportedMegatronCoreError(TenplexError, ImportError):
    """The megatron-core that would be imported is outside the supported range."""


class StateLayoutError(TenplexError, ValueError):
    """A checkpoint written with a megatron-core state layout the installed version does not reproduce."""


class MegatronCoreVersionError(TenplexError, ValueError):
    """A megatron-core version that does not read as MAJOR.MINOR[.PATCH]; the message quotes it."""


@dataclass(frozen=True)
class MegatronCoreVersion:
    """A megatron-core version as found: its text, (major, minor, patch), and where it was read from."""

    text: str
    release: tuple[int, int, int]
    source: str


def parse(text: str) -> tuple[int, int, int]:
    """``"0.19.0"``, ``"0.16.0rc0.dev1"``, ``"0.15.3+abc"`` -> (major, minor, patch)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise MegatronCoreVersionError(f"not a megatron-core version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _from_package_info(path: str) -> str | None:
    """The version a ``megatron/core/package_info.py`` declares (MAJOR, MINOR, PATCH, PRE_RELEASE), without running it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    parts = {}
    for name in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
        m = re.search(rf"^{name}\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M)
        parts[name] = m.group(1).strip() if m else ""
    if not (parts["MAJOR"].isdigit() and parts["MINOR"].isdigit()):
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH'] or 0}{parts['PRE_RELEASE']}"


def installed() -> MegatronCoreVersion | None:
    """The megatron-core ``import megatron.core`` would load (None: none is importable)."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        info = os.path.join(location, "core", "package_info.py")
        text = _from_package_info(info)
        if text is not None:
            return MegatronCoreVersion(text, parse(text), info)
    try:
        text = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    return MegatronCoreVersion(text, parse(text), "megatron-core's installed metadata")


def supported(release: tuple[int, ...]) -> bool:
    return MIN <= tuple(release[:2]) < BELOW


def check_supported(version: MegatronCoreVersion | None = None) -> MegatronCoreVersion | None:
    """Raise :class:`UnsupportedMegatronCoreError` for a megatron-core outside ``SUPPORTED`` (None: none installed,
    left to the import that needs it)."""
    version = installed() if version is None else version
    if version is not None and not supported(version.release):
        raise UnsupportedMegatronCoreError(
            f"tenplex-megatron supports megatron-core {SUPPORTED} (tested: {', '.join(TESTED)}); the megatron-core "
            f"found is {version.text} ({version.source}): install a supported one, e.g. "
            f"pip install 'megatron-core{SUPPORTED}'")
    return version


#: the NVRx megatron-core 0.17.1+ asks for when one is installed (its import asserts it: dist_checkpointing's nvrx.py,
#: from core_v0.17.1; 0.17.0 and older do not)
NVRX_FOR_MCORE_019 = (0, 6)
#: the first megatron-core release whose import asserts :data:`NVRX_FOR_MCORE_019`
NVRX_ASSERTED_FROM = (0, 17, 1)


class NVRxMismatchError(TenplexError, ImportError):
    """The installed nvidia-resiliency-ext is older than the installed megatron-core asks for."""


def nvrx_installed() -> str | None:
    """The installed nvidia-resiliency-ext's version (None: not installed, or not importable here: megatron-core
    asserts its version only where it imports)."""
    try:
        if importlib.util.find_spec("nvidia_resiliency_ext") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_nvrx(version: MegatronCoreVersion | None = None, nvrx: str | None = None) -> None:
    """Refuse (:class:`NVRxMismatchError`, naming both versions and the fix) an nvidia-resiliency-ext older than
    0.6 beside megatron-core 0.17.1+, which asserts it; ``version``/``nvrx``: the installed ones by default."""
    version = installed() if version is None else version
    nvrx = nvrx_installed() if nvrx is None else nvrx
    if version is None or nvrx is None or version.release[:3] < NVRX_ASSERTED_FROM:
        return
    if parse(nvrx)[:2] < NVRX_FOR_MCORE_019:
        raise NVRxMismatchError(
            f"megatron-core {version.text} needs nvidia-resiliency-ext >= 0.6 when one is installed; "
            f"nvidia-resiliency-ext {nvrx} is: on Python 3.12 pip install 'nvidia-resiliency-ext>=0.6' "
            "(tenplex-megatron[inprocess] does), on Python 3.11 use megatron-core <= 0.17.0 with 0.4.1")


def state_layout(release: tuple[int, ...]) -> str:
    """The state layout id megatron-core ``release`` writes and reads."""
    for layout, (lo, below) in STATE_LAYOUTS.items():
        if lo <= tuple(release[:2]) < below:
            return layout
    raise StateLayoutError(f"megatron-core {'.'.join(map(str, release))}: no known state layout "
                           f"(supported: {SUPPORTED})")


def record(version: MegatronCoreVersion | None = None) -> dict[str, str]:
    """What a checkpoint records of the megatron-core that wrote it: ``{"version", "state_layout"}``."""
    version = installed() if version is None else version
    if version is None:
        return {}
    return {"version": version.text, "state_layout": state_layout(version.release)}


def check_checkpoint(recorded: dict[str, str] | None, path: str, version: MegatronCoreVersion | None = None) -> None:
    """Refuse a checkpoint whose recorded state layout the installed megatron-core cannot reproduce, naming the
    checkpoint, both versions and both layouts. A checkpoint that records none (written before versions were
    recorded, by 0.16.1) is read as ``STATE_LAYOUT_V1``."""
    version = installed() if version is None else version
    if version is None or not recorded:
        return
    theirs = recorded.get("state_layout", STATE_LAYOUT_V1)
    ours = state_layout(version.release)
    if theirs != ours:
        raise StateLayoutError(
            f"{path}: written by megatron-core {recorded.get('version', '?')} with state layout {theirs!r}; the "
            f"installed megatron-core {version.text} reads {ours!r} only: load it with a megatron-core whose "
            f"layout is {theirs!r}, or re-save it there")
