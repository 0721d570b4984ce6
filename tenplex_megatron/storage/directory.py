"""The checkpoint directory layout, the metadata file and the atomic commit.

``<save>/iter_NNNNNNN/`` holds ``metadata.json`` (versioned JSON: the PTC,
iteration, optimizer and scheduler state, RNG, data position) and one
``rank_RRRRR.safetensors`` per writing rank. It is written under
``iter_NNNNNNN.tenplex-partial`` and renamed into place only once every rank
has written and synced its file; ``latest_checkpointed_iteration.txt`` (the
name Megatron-LM uses) is updated after that, atomically. A directory without
``metadata.json`` is never chosen.

Every name read from a checkpoint (the tracker's iteration, the metadata's
``files``) is confined to its directory (``confine.py``). Deletion is confined
too: only directories this project made are removed (a real ``iter_NNNNNNN``
directory holding a tenplex ``metadata.json``; an ``iter_NNNNNNN.tenplex-partial``
holding nothing but shard and metadata files); a symbolic link named like one is
unlinked at most, never followed; anything else is left alone. A process holding the directory's lease
(``lease.py``) commits, applies retention and removes partial saves only while its generation is the newest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from tenplex_megatron.flags import FlagError
from tenplex_megatron.plan.megatron_ckpt_flags import Retention
from tenplex_megatron.plan.versioned import VersionedFormat
from tenplex_megatron.storage import formats, lease
from tenplex_megatron.storage.bounded import open_regular
from tenplex_megatron.storage.checkpoint_metadata import FORMAT_NAME, FORMAT_VERSION, CheckpointMetadata
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.files import CheckpointFileError, fsync_dir, fsync_file
from tenplex_megatron.storage.formats import is_tenplex_checkpoint, load_metadata_json

# FORMAT_VERSION (checkpoint_metadata.py) 2: a CRC-32 per fixed-size block of each stored tensor (``block_crc32`` +
#    ``block_bytes``), so a load checks only the blocks it reads; 1: one ``crc32`` per stored tensor (still read:
#    such tensors are checked whole).
READ_VERSIONS = (1, 2)
METADATA_FORMAT = VersionedFormat(f"{FORMAT_NAME} metadata file", "format_version", READ_VERSIONS, CheckpointFileError,
                                  name=FORMAT_NAME, version_label="format version")
METADATA_FILE = formats.METADATA_FILE
TRACKER_FILE = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".tenplex-partial"
OLD_SUFFIX = ".tenplex-old"
_ITER_RE = re.compile(r"iter_([0-9]{7,})")  # always fullmatch: ``$`` would let a trailing newline through
_PARTIAL_RE = re.compile(r"iter_[0-9]{7,}\.tenplex-partial")
_STAGED_FILE_RE = re.compile(r"rank_[0-9]{5,}\.safetensors|metadata\.json")  # all a save writes in staging
_TRACKER_RE = re.compile(r"[0-9]+")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(ckpt_dir: str) -> int | None:
    """The iteration an ``iter_NNNNNNN`` directory's name says (None for another name), without reading it."""
    m = _ITER_RE.fullmatch(os.path.basename(os.path.normpath(ckpt_dir)))
    return int(m.group(1)) if m else None


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def partial_dir(save: str, iteration: int) -> str:
    return os.path.join(save, iter_dir_name(iteration) + PARTIAL_SUFFIX)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` via a synced temporary file and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def find_megatron_checkpoint(load: str) -> str | None:
    """Megatron's own checkpoint under ``load`` (tracker, then newest ``iter_*``), if any: megatron-core's
    dist_checkpointing (``metadata.json`` naming a sharded backend) or Megatron-LM's legacy format."""
    is_mcore = formats.is_megatron_checkpoint
    if is_mcore(load):
        return load
    it = _readable_tracker(load)
    if it is not None:
        path = confine(load, iter_dir_name(it), TRACKER_FILE)
        if is_mcore(path):
            return path
    if os.path.isdir(load):
        for name in sorted(os.listdir(load), reverse=True):
            if _ITER_RE.fullmatch(name) and _real_dir(os.path.join(load, name)) and is_mcore(os.path.join(load, name)):
                return os.path.join(load, name)
    return None


def tracker_iteration(save: str) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names: ASCII digits only, else None (Megatron's "release").

    The tracker is opened bounded (``bounded.py``): confined to ``save``, a regular file (a FIFO or a device raises
    :class:`CheckpointFileError`), its first 64 bytes read."""
    try:
        path = confine(save, TRACKER_FILE, "the checkpoint format")
        with open_regular(path) as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if _TRACKER_RE.fullmatch(text.decode("ascii", "replace")) else None


def _readable_tracker(save: str) -> int | None:
    """:func:`tracker_iteration`, None when the tracker is not a regular file in ``save`` (``storage/copies.py``
    reports that as damage)."""
    try:
        return tracker_iteration(save)
    except CheckpointFileError:
        return None


def _real_dir(path: str) -> bool:
    """A directory that is not a symbolic link (the only kind this project creates, reads by scanning, or deletes)."""
    return os.path.isdir(path) and not os.path.islink(path)


def read_checkpoint_metadata(ckpt_dir: str) -> CheckpointMetadata:
    """Read ``metadata.json`` of a committed checkpoint directory, every field checked (:class:`CheckpointMetadata`);
    anything malformed is one :class:`CheckpointFileError` naming the file and the field."""
    path = os.path.join(ckpt_dir, METADATA_FILE)
    try:
        meta = load_metadata_json(ckpt_dir)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: missing (not a complete tenplex checkpoint)") from None
    return checked_metadata(ckpt_dir, meta)


def checked_metadata(ckpt_dir: str, meta: Any) -> CheckpointMetadata:
    """``ckpt_dir``'s ``metadata.json`` document (parsed once by the caller) checked as :func:`read_checkpoint_metadata`
    checks it: the format and version, every field, every file name confined."""
    path = os.path.join(ckpt_dir, METADATA_FILE)
    METADATA_FORMAT.check(meta, path)
    typed = CheckpointMetadata.from_json(meta, path)
    for name in typed.files or {}:
        confine(ckpt_dir, name, f"{METADATA_FILE} ('files')")
    return typed


def read_metadata(ckpt_dir: str) -> dict[str, Any]:
    """``metadata.json`` of a committed checkpoint directory as its JSON document, every field checked
    (:func:`read_checkpoint_metadata` gives the typed record)."""
    return dict(read_checkpoint_metadata(ckpt_dir).raw)


def committed_iterations(save: str) -> list[int]:
    """Iterations of complete checkpoints under ``save`` (ascending): real directories (a symbolic link named
    like one is not this project's) holding a tenplex ``metadata.json``."""
    if not os.path.isdir(save):
        return []
    out = []
    for name in os.listdir(save):
        m = _ITER_RE.fullmatch(name)
        if m and _real_dir(os.path.join(save, name)) and is_tenplex_checkpoint(os.path.join(save, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def find_checkpoint(load: str, iteration: int | None = None) -> str | None:
    """The directory to load: ``load`` itself if it is one, else the tracker's or the newest complete one."""
    if is_tenplex_checkpoint(load) and not os.path.normpath(load).endswith(PARTIAL_SUFFIX):
        return load
    if iteration is not None:
        path = confine(load, iter_dir_name(iteration), "the requested iteration")
        return path if is_tenplex_checkpoint(path) else None
    it = _readable_tracker(load)
    if it is not None:
        path = confine(load, iter_dir_name(it), TRACKER_FILE)
        if is_tenplex_checkpoint(path):
            return path
    its = committed_iterations(load)
    return os.path.join(load, iter_dir_name(its[-1])) if its else None


def partial_dirs(save: str) -> list[str]:
    """Left-overs of saves that never committed: entries named ``iter_NNNNNNN.tenplex-partial``."""
    if not os.path.isdir(save):
        return []
    return sorted(os.path.join(save, n) for n in os.listdir(save) if _PARTIAL_RE.fullmatch(n))


def is_staging_dir(path: str) -> bool:
    """A staging directory as a save leaves it: a real directory holding nothing but shard and metadata files."""
    if not _real_dir(path):
        return False
    try:
        with os.scandir(path) as entries:
            return all(_STAGED_FILE_RE.fullmatch(e.name) and not e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


def _is_committed_dir(path: str) -> bool:
    return _real_dir(path) and is_tenplex_checkpoint(path)


def remove_own(path: str, recognised: Callable[[str], bool]) -> bool:
    """Delete ``path`` if this project made it; returns whether it did.

    A symbolic link is unlinked, never followed (its target is untouched); a
    directory goes only if ``recognised(path)`` (removed without following the
    links inside it); anything else is left alone.
    """
    if os.path.islink(path):
        os.unlink(path)
        return True
    if recognised(path):
        shutil.rmtree(path)
        return True
    return False


def remove_partial(path: str, fence: lease.Fence = lease.no_fence) -> bool:
    """Delete a left-over staging directory (:func:`partial_dirs`) if it is one this project wrote (never by a
    writer whose lease a newer generation took, ``fence``: it could be that writer's save in progress)."""
    fence(os.path.dirname(os.path.abspath(path)))
    return _PARTIAL_RE.fullmatch(os.path.basename(path)) is not None and remove_own(path, is_staging_dir)


def _check_replaceable(final: str) -> None:
    """A save of an iteration may replace only a tenplex checkpoint of it (or a link named like one)."""
    if os.path.lexists(final) and not os.path.islink(final) and not _is_committed_dir(final):
        raise CheckpointFileError(
            f"{final}: exists and is not a tenplex checkpoint (another format's, or not a checkpoint at all); "
            "refusing to replace it: move it away or save elsewhere"
        )


def prepare_partial(save: str, iteration: int, fence: lease.Fence = lease.no_fence) -> str:
    """Create an empty staging directory (rank 0, before the writers start).

    Refuses, before anything is written, to replace anything at the iteration's
    name that is not a tenplex checkpoint, or a staging entry it did not write (``fence``: the writer's lease).
    """
    os.makedirs(save, exist_ok=True)
    _check_replaceable(os.path.join(save, iter_dir_name(iteration)))
    path = partial_dir(save, iteration)
    if os.path.lexists(path) and not remove_partial(path, fence):
        raise CheckpointFileError(f"{path}: exists and is not a staging directory of a tenplex save "
                                  "(it holds other files); refusing to delete it")
    os.makedirs(path)
    return path


def commit(
    save: str, iteration: int, metadata: dict[str, Any], expected_files: dict[str, int],
    fault: Callable[[str], None] | None = None, dispose: Callable[[str], None] = shutil.rmtree,
    fence: lease.Fence = lease.no_fence,
) -> str:
    """Check every rank's file, write the metadata, rename into place, update the tracker (rank 0).

    ``dispose``: what happens to a committed checkpoint of the same iteration once the new one replaced it (renamed
    ``iter_NNNNNNN.tenplex-old`` by then): deleted at once unless the caller defers it. ``fence``: the writer's
    lease, checked before the rename (a writer of an older generation commits nothing).
    """
    fault = fault or (lambda point: None)
    staging = partial_dir(save, iteration)
    final = os.path.join(save, iter_dir_name(iteration))
    _check_replaceable(final)
    for name, size in expected_files.items():
        path = confine(staging, name, "the list of rank files")
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path}: a rank's shard file is missing at commit")
        if os.path.getsize(path) != size:
            raise CheckpointFileError(f"{path}: size {os.path.getsize(path)} != {size} written")
    meta_path = os.path.join(staging, METADATA_FILE)
    text = json.dumps(metadata, sort_keys=True)
    with open(meta_path, "w") as f:
        f.write(text[: len(text) // 2])
        f.flush()
        fault("save.metadata")
        f.write(text[len(text) // 2 :])
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)
    fault("save.commit")
    fence(save)  # a writer of an older generation commits nothing
    if os.path.islink(final):  # a link named like the checkpoint: replaced by it, its target untouched
        os.unlink(final)
    if os.path.lexists(final):
        old = final + OLD_SUFFIX
        if os.path.lexists(old) and not remove_own(old, _is_committed_dir):
            raise CheckpointFileError(f"{old}: exists and is not a tenplex checkpoint; refusing to delete it")
        os.replace(final, old)
        os.replace(staging, final)
        dispose(old)
    else:
        os.replace(staging, final)
    fsync_dir(save)
    tracker = os.path.join(save, TRACKER_FILE)
    tmp = tracker + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    fsync_dir(save)
    return final


def apply_retention(save: str, keep: int | Retention, fence: lease.Fence = lease.no_fence) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, or all but what a :class:`Retention` keeps (call
    only after a commit, under the writer's ``fence``); returns what went.

    Only :func:`committed_iterations` count and go: real ``iter_NNNNNNN``
    directories with a tenplex ``metadata.json``. Links named like them and
    other formats' directories are neither counted nor touched.
    """
    rule = keep if isinstance(keep, Retention) else Retention(keep=keep)
    if rule.keep is not None and rule.keep < 1:
        raise FlagError(f"--tenplex-keep must be >= 1, got {rule.keep}")
    fence(save)
    removed = []
    its = committed_iterations(save)
    kept = set(rule.kept(its))
    for it in (i for i in its if i not in kept):
        path = os.path.join(save, iter_dir_name(it))
        if remove_own(path, _is_committed_dir):
            removed.append(path)
    if removed:
        fsync_dir(save)
    return removed


__all__ = [
    "apply_retention",
    "CheckpointFileError",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "commit",
    "committed_iterations",
    "find_checkpoint",
    "fsync_file",
    "iter_dir_name",
    "partial_dirs",
    "prepare_partial",
    "rank_file_name",
    "read_checkpoint_metadata",
    "read_metadata",
    "remove_own",
    "remove_partial",
    "tracker_iteration",
    "write_json_atomic",
]
