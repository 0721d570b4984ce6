"""The checkpoint directory layout, the metadata file and the atomic commit.

``<save>/iter_NNNNNNN/`` holds ``metadata.json`` (versioned JSON: the PTC,
iteration, optimizer and scheduler state, RNG, data position) and one
``rank_RRRRR.safetensors`` per writing rank. It is written under
``iter_NNNNNNN.tenplex-partial`` and renamed into place only once every rank
has written and synced its file; ``latest_checkpointed_iteration.txt`` (the
name Megatron-LM uses) is updated after that, atomically. A directory without
``metadata.json`` is never chosen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from tenplex_megatron.storage.files import CheckpointFileError, fsync_dir, fsync_file

FORMAT_NAME = "tenplex-megatron"
# 2: a CRC-32 per fixed-size block of each stored tensor (``block_crc32`` + ``block_bytes``), so a load checks only
#    the blocks it reads; 1: one ``crc32`` per stored tensor (still read: such tensors are checked whole).
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
METADATA_FILE = "metadata.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".tenplex-partial"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


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


def is_tenplex_checkpoint(path: str) -> bool:
    """A committed tenplex checkpoint (megatron-core's torch_dist format also writes a metadata.json)."""
    try:
        with open(os.path.join(path, METADATA_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT_NAME


def find_megatron_checkpoint(load: str) -> str | None:
    """A megatron-core dist_checkpointing checkpoint under ``load`` (tracker, then newest ``iter_*``), if any."""
    def is_mcore(path: str) -> bool:
        try:
            with open(os.path.join(path, METADATA_FILE)) as f:
                return "sharded_backend" in json.load(f)
        except (OSError, ValueError, TypeError, RecursionError):
            return False

    if is_mcore(load):
        return load
    tracker = os.path.join(load, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text.isdigit() and is_mcore(os.path.join(load, iter_dir_name(int(text)))):
            return os.path.join(load, iter_dir_name(int(text)))
    if os.path.isdir(load):
        for name in sorted(os.listdir(load), reverse=True):
            if _ITER_RE.match(name) and is_mcore(os.path.join(load, name)):
                return os.path.join(load, name)
    return None


def read_metadata(ckpt_dir: str) -> dict[str, Any]:
    """Read and check ``metadata.json`` of a committed checkpoint directory."""
    path = os.path.join(ckpt_dir, METADATA_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: missing (not a complete tenplex checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointFileError(f"{path}: malformed JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointFileError(f"{path}: not a {FORMAT_NAME} metadata file")
    version = meta.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise CheckpointFileError(
            f"{path}: format version {version!r}, this build reads {', '.join(map(str, READ_VERSIONS))}"
        )
    return meta


def committed_iterations(save: str) -> list[int]:
    """Iterations of complete checkpoints under ``save`` (ascending)."""
    if not os.path.isdir(save):
        return []
    out = []
    for name in os.listdir(save):
        m = _ITER_RE.match(name)
        if m and is_tenplex_checkpoint(os.path.join(save, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def find_checkpoint(load: str, iteration: int | None = None) -> str | None:
    """The directory to load: ``load`` itself if it is one, else the tracker's or the newest complete one."""
    if is_tenplex_checkpoint(load) and not os.path.normpath(load).endswith(PARTIAL_SUFFIX):
        return load
    if iteration is not None:
        path = os.path.join(load, iter_dir_name(iteration))
        return path if is_tenplex_checkpoint(path) else None
    tracker = os.path.join(load, TRACKER_FILE)
    if os.path.isfile(tracker):
        try:
            with open(tracker) as f:
                it = int(f.read().strip())
            path = os.path.join(load, iter_dir_name(it))
            if is_tenplex_checkpoint(path):
                return path
        except ValueError:
            pass
    its = committed_iterations(load)
    return os.path.join(load, iter_dir_name(its[-1])) if its else None


def partial_dirs(save: str) -> list[str]:
    """Left-over directories of saves that never committed."""
    if not os.path.isdir(save):
        return []
    return sorted(os.path.join(save, n) for n in os.listdir(save) if n.endswith(PARTIAL_SUFFIX))


def prepare_partial(save: str, iteration: int) -> str:
    """Create an empty staging directory (rank 0, before the writers start)."""
    os.makedirs(save, exist_ok=True)
    path = partial_dir(save, iteration)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def commit(
    save: str, iteration: int, metadata: dict[str, Any], expected_files: dict[str, int],
    fault: Callable[[str], None] | None = None,
) -> str:
    """Check every rank's file, write the metadata, rename into place, update the tracker (rank 0)."""
    fault = fault or (lambda point: None)
    staging = partial_dir(save, iteration)
    for name, size in expected_files.items():
        path = os.path.join(staging, name)
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
    final = os.path.join(save, iter_dir_name(iteration))
    if os.path.exists(final):
        old = final + ".tenplex-old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
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


def apply_retention(save: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints (call only after a commit); returns what went."""
    if keep < 1:
        raise ValueError(f"--tenplex-keep must be >= 1, got {keep}")
    removed = []
    for it in committed_iterations(save)[:-keep]:
        path = os.path.join(save, iter_dir_name(it))
        shutil.rmtree(path)
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
    "read_metadata",
    "write_json_atomic",
]
