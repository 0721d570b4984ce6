"""What several ``python -m tenplex_megatron`` commands share: their error, byte counts as text, a tenplex
checkpoint opened and checked, Megatron's own found, a re-shard planned. Never imports torch."""

from __future__ import annotations

from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.planner import PlanError, plan_reshard
from tenplex_megatron.plan.ptc import PTC, PTCError
from tenplex_megatron.plan.sim.sharding import layout_chunks, resize_vocab
from tenplex_megatron.storage import copies
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.confine import confine_all
from tenplex_megatron.storage.directory import find_checkpoint, find_megatron_checkpoint
from tenplex_megatron.storage.files import CheckpointFileError


class CLIError(TenplexError, RuntimeError):
    """A bad argument, or a checkpoint or directory a command cannot use: printed without a traceback, exit 2."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes as text in decimal units (``1.50 GB``; whole bytes below a kilobyte)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def read_tenplex(path: str) -> tuple[str, CheckpointMetadata, PTC]:
    """The tenplex checkpoint under ``path``, its metadata checked field by field (a bad one: one error line)."""
    try:
        copy, _ = copies.choose(path)  # every copy damaged: an error naming each
    except CheckpointFileError as e:
        raise CLIError(str(e)) from None
    if copy is None or copy.metadata is None:
        raise CLIError(f"{path}: no complete tenplex checkpoint here")
    ckpt, meta = copy.path, copy.metadata  # read and checked once, by the choice
    try:
        ptc = meta.require_ptc()
        confine_all(ckpt, (sc.location.file for sc in ptc.chunks))
    except (CheckpointFileError, PTCError) as e:
        raise CLIError(f"{ckpt}: {e}") from None
    return ckpt, meta, ptc


def megatron_checkpoint(path: str) -> str | None:
    """Megatron's own checkpoint under ``path`` when there is no tenplex one."""
    if find_checkpoint(path) is not None:
        return None
    try:
        return find_megatron_checkpoint(path)
    except (CheckpointFileError, OSError):
        return None


def plan_to(source: PTC, dst: ParallelLayout, distopt: bool, padded: int) -> Any:
    """The plan from ``source`` to ``dst`` (every element covered exactly once), or the reasons it cannot be."""
    try:
        tensors = resize_vocab(source.tensors, padded)
        chunks = layout_chunks(tensors, dst, distopt)
        return plan_reshard(source, tensors, chunks, strict=True)
    except (LayoutError, PlanError) as e:
        raise CLIError(str(e)) from None
