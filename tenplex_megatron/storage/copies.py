"""Which copy of a checkpoint directory a restart loads, and why each newer one cannot be: never a silent fresh start.

A directory that holds a copy (a ``metadata.json`` or rank files directly, a tracker naming an iteration, an
``iter_NNNNNNN`` directory with tenplex files) was written by a job that committed a save: a restart from it must
load state. :func:`choose` returns the newest copy whose ``metadata.json`` reads (bounded, ``bounded.py``) and
checks (``directory.read_metadata``), with every newer copy that does not and why, for the one fallback warning
(``memory/fallback.py``); when every copy is damaged it raises :class:`NoGoodCopyError` naming each one and why.
Megatron's own checkpoints (megatron-core's ``metadata.json`` naming a sharded backend, Megatron-LM's legacy
``mp_rank_*`` directories) are not tenplex copies and are left to the adoption path. Damage found only when the
rank files are read (a checksum, a truncated file) is the load's to find: the fallback then tries the next copy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tenplex_megatron.storage import directory, formats
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.files import CheckpointFileError

_ITER_RE = re.compile(r"iter_([0-9]{7,})")
_RANK_FILE_RE = re.compile(r"rank_[0-9]{5,}\.safetensors")


class NoGoodCopyError(CheckpointFileError):
    """Every copy of the state a restart could load failed its checks."""


@dataclass(frozen=True)
class Copy:
    """One copy under a load directory: where, its iteration (None: the directory itself), and why it cannot be
    loaded (None: its metadata reads and checks)."""

    path: str
    iteration: int | None
    why: str | None
    metadata: CheckpointMetadata | None = field(default=None, compare=False)  # its record, read once (good copies)

    def describe(self) -> str:
        return f"{self.path}: {self.why}" if self.why else self.path


def _foreign(path: str) -> bool:
    """Megatron's own checkpoint (megatron-core's torch_dist or the legacy format): not a tenplex copy."""
    return formats.is_megatron_checkpoint(path)


def _holds_tenplex_files(path: str) -> bool:
    """A real directory holding a ``metadata.json`` (of any kind: a damaged one too) or a rank file of ours."""
    try:
        with os.scandir(path) as entries:
            return any(e.name == directory.METADATA_FILE or _RANK_FILE_RE.fullmatch(e.name) for e in entries)
    except OSError:
        return False


def _classify(path: str, iteration: int | None) -> Copy | None:
    """The copy at ``path`` with its metadata read once and checked (its record kept), or why it cannot be loaded;
    None for Megatron's own checkpoint (not a tenplex copy: the adoption path's)."""
    if formats.is_legacy_megatron_checkpoint(path):
        return None
    try:
        raw = formats.load_metadata_json(path)
        if isinstance(raw, dict) and "sharded_backend" in raw:
            return None
        return Copy(path, iteration, None, directory.checked_metadata(path, raw))
    except FileNotFoundError:
        return Copy(path, iteration, f"{directory.METADATA_FILE}: missing (not a complete tenplex checkpoint)")
    except CheckpointFileError as e:
        return Copy(path, iteration, str(e).removeprefix(path + "/").removeprefix(path + ": "))
    except OSError as e:
        return Copy(path, iteration, f"cannot be read ({e.strerror or e})")


def scan(load_dir: str) -> list[Copy]:
    """Every tenplex copy under ``load_dir``, newest first: ``load_dir`` itself when it is one, else its real
    ``iter_NNNNNNN`` directories holding tenplex files, and the tracker's iteration (missing, or unreadable, it is a
    copy that cannot be loaded: a committed save wrote the tracker). Raises nothing for damage: it is recorded."""
    itself = _classify(load_dir, None) if os.path.isdir(load_dir) and _holds_tenplex_files(load_dir) else None
    if itself is not None:
        return [itself]
    found: dict[int, Copy] = {}
    if os.path.isdir(load_dir):
        for name in os.listdir(load_dir):
            m = _ITER_RE.fullmatch(name)
            path = os.path.join(load_dir, name)
            if m and os.path.isdir(path) and not os.path.islink(path) and _holds_tenplex_files(path) \
                    and (copy := _classify(path, int(m.group(1)))) is not None:
                found[int(m.group(1))] = copy
    tracker = os.path.join(load_dir, directory.TRACKER_FILE)
    try:
        named = directory.tracker_iteration(load_dir)
    except CheckpointFileError as e:
        found[-1] = Copy(tracker, None, str(e).removeprefix(tracker + ": "))
        named = None
    if named is not None and named not in found:
        path = os.path.join(load_dir, directory.iter_dir_name(named))
        if not os.path.lexists(path):
            found[named] = Copy(path, named, f"{directory.TRACKER_FILE} names iteration {named}, which is missing")
        elif os.path.islink(path) or not os.path.isdir(path):
            found[named] = Copy(path, named, f"{directory.TRACKER_FILE} names it, and it is not a real directory")
        elif not _foreign(path):
            found[named] = Copy(path, named, f"{directory.TRACKER_FILE} names it, and it holds no checkpoint files")
    return [found[k] for k in sorted(found, reverse=True)]


def choose(load_dir: str) -> tuple[Copy | None, tuple[Copy, ...]]:
    """The newest copy under ``load_dir`` whose metadata reads, with its record (None: ``load_dir`` holds no tenplex
    copy at all) and
    the damaged copies newer than it, each with why; :class:`NoGoodCopyError` when there are copies and none
    reads. The tracker's iteration is preferred when it reads (a newer directory may be another job's, or one the
    tracker was not yet moved to)."""
    copies = scan(load_dir)
    good = [c for c in copies if c.why is None]
    if not good:
        if len(copies) == 1 and copies[0].iteration is None and copies[0].path == load_dir:
            try:  # the directory is the one copy (a path to an iteration): its own error, as one line
                directory.read_metadata(load_dir)
            except CheckpointFileError as e:
                raise NoGoodCopyError(str(e)) from None
        if copies:
            raise NoGoodCopyError(f"{load_dir}: no loadable copy of the checkpoint is left (refusing to start from "
                                  "scratch over it); copies tried:\n  " + "\n  ".join(c.describe() for c in copies))
        return None, ()
    try:
        named = directory.tracker_iteration(load_dir)
    except CheckpointFileError:
        named = None
    pick = next((c for c in good if named is not None and c.iteration == named), good[0])
    newer = tuple(c for c in copies if c.why is not None
                  and (c.iteration is None or pick.iteration is None or c.iteration > pick.iteration))
    return pick, newer


__all__ = ["Copy", "NoGoodCopyError", "choose", "scan"]
