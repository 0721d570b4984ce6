"""A node's memory directory: its node id, its snapshots listed, retention, spare files and cleaning.

A memory directory (``--tenplex-memory``, under /dev/shm by default) stands
for one node: it holds ``tenplex-node.json`` (an id made once, so a node is
known by its memory, not by torchrun's node rank) and snapshot directories in
the format of a tenplex checkpoint (``iter_NNNNNNN/`` with ``metadata.json``
and the rank files this node holds: its own ranks' and replicas of other
nodes'), committed with ``directory.commit``. A snapshot is complete on a set
of nodes when their files together cover the metadata's ``files``. A retired
snapshot leaves its own ranks' files in ``tenplex-spare/``: the next snapshot
writes over their pages instead of allocating fresh ones.
Everything here is local file work: which snapshot a restart loads is
``plan/restart_policy.py`` (pure), the collectives are the other modules of ``memory/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable

from tenplex_megatron.flags import FlagError
from tenplex_megatron.plan.restart_policy import DurableListing, Snapshot
from tenplex_megatron.plan.versioned import VersionedFormat
from tenplex_megatron.storage import directory, formats, lease
from tenplex_megatron.storage.bounded import METADATA_MAX_ENV, metadata_cap, read_checkpoint_file
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.faults import log_open
from tenplex_megatron.storage.files import CheckpointFileError

NODE_FILE = "tenplex-node.json"
NODE_FORMAT = "tenplex-memory-node"
NODE_VERSION = 1
NODE_ID_FORMAT = VersionedFormat(f"{NODE_FORMAT} file", "version", (NODE_VERSION,), CheckpointFileError,
                                 name=NODE_FORMAT)
SPARE_DIR = "tenplex-spare"  # retired snapshots' own rank files, overwritten by the next snapshot
_SPARE_RE = re.compile(r"rank_\d{5}\.safetensors")


def node_id(mem: str) -> str:
    """This node's id, read from ``mem/tenplex-node.json`` or made there once (atomically: ranks may race)."""
    os.makedirs(mem, exist_ok=True)
    path = os.path.join(mem, NODE_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": NODE_FORMAT, "version": NODE_VERSION, "node": uuid.uuid4().hex}, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another rank of this node made it first: its id wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    log_open(path)
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointFileError(f"{path}: unreadable node id ({e}); remove it to make a new one") from None
    NODE_ID_FORMAT.check(got, path)
    if not isinstance(got.get("node"), str):
        raise CheckpointFileError(f"{path}: not a {NODE_FORMAT} file (its 'node' is not a string)")
    return got["node"]


def snapshot_dir(mem: str, iteration: int) -> str:
    return os.path.join(mem, directory.iter_dir_name(iteration))


def list_snapshots(mem: str, node: str) -> list[Snapshot]:
    """The committed snapshots in this node's memory directory, oldest first."""
    out = []
    for it in directory.committed_iterations(mem):
        path = snapshot_dir(mem, it)
        log_open(os.path.join(path, directory.METADATA_FILE))
        digest, meta = _digest_and_metadata(path)
        expected = dict(meta.files or {})
        present = {}
        for name in expected:
            p = os.path.join(path, name)
            if os.path.isfile(p):
                present[name] = os.path.getsize(p)
        out.append(Snapshot(node, it, meta.memory_job or "", digest, expected, present))
    return out


def _digest_and_metadata(path: str) -> tuple[str, CheckpointMetadata]:
    """A checkpoint directory's metadata: the SHA-256 of its bytes (which tells snapshots apart) and its content."""
    raw = read_checkpoint_file(path, directory.METADATA_FILE, metadata_cap(), METADATA_MAX_ENV)  # bounded
    return hashlib.sha256(raw).hexdigest(), directory.read_checkpoint_metadata(path)


def durable_listing(path: str) -> DurableListing:
    """A committed durable checkpoint directory's listing (its metadata's digest: a snapshot persisted there has the
    same metadata bytes, so the same digest)."""
    digest, meta = _digest_and_metadata(path)
    present = {}
    for name in meta.files or {}:
        p = os.path.join(path, name)
        if os.path.isfile(p) and not os.path.islink(p):
            present[name] = os.path.getsize(p)
    return DurableListing(meta.require_iteration(), digest, present)


def free_bytes(mem: str) -> int:
    """Bytes free for an unprivileged writer in the filesystem holding ``mem``."""
    st = os.statvfs(mem)
    return st.f_bavail * st.f_frsize


def used_bytes(mem: str, iterations: list[int]) -> int:
    """Bytes held by the given snapshots of ``mem``."""
    total = 0
    for it in iterations:
        path = snapshot_dir(mem, it)
        if os.path.isdir(path):
            total += sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return total


def retain(mem: str, keep: int, protect: tuple[int, ...] = (),
           dispose: Callable[[str], None] | None = None, fence: lease.Fence = lease.no_fence) -> list[str]:
    """Retire all but the newest ``keep`` committed snapshots (and those in ``protect``); returns what went.

    ``dispose``: each retired snapshot is renamed ``iter_NNNNNNN.tenplex-old`` (no longer listed) and handed to it,
    to be deleted off the training path (freeing a GB of tmpfs pages takes a while); None: deleted here.
    ``fence``: the job's lease on ``mem``, checked first.
    """
    if keep < 1:
        raise FlagError(f"--tenplex-memory-keep must be >= 1, got {keep}")
    fence(mem)
    removed = []
    for it in directory.committed_iterations(mem)[:-keep]:
        if it in protect:
            continue
        path = snapshot_dir(mem, it)
        if dispose is None:
            if directory.remove_own(path, formats.is_tenplex_checkpoint):
                removed.append(path)
        elif _retire(path, dispose):
            removed.append(path)
    return removed


def _retire(path: str, dispose: Callable[[str], None]) -> bool:
    """Rename the snapshot ``path`` to ``iter_NNNNNNN.tenplex-old`` (out of the listing) and hand it to ``dispose``;
    False where a ``.tenplex-old`` of that name is not ours (left alone, and this snapshot with it)."""
    old = path + directory.OLD_SUFFIX
    if os.path.lexists(old) and not directory.remove_own(old, formats.is_tenplex_checkpoint):
        return False
    os.replace(path, old)
    dispose(old)
    return True


def discard_newer(mem: str, iteration: int | None, dispose: Callable[[str], None],
                  fence: lease.Fence = lease.no_fence) -> list[str]:
    """Retire the committed snapshots after ``iteration`` (every one for None) as :func:`retain` does, under the
    job's ``fence``: the snapshots of a timeline a restart left (it went back to ``iteration``), which must never
    complete later, when a lost node returns with its part of them. Returns what went."""
    fence(mem)
    newer = [snapshot_dir(mem, it) for it in directory.committed_iterations(mem) if iteration is None or it > iteration]
    return [path for path in newer if _retire(path, dispose)]


def spare_path(mem: str, rank: int) -> str:
    """Where rank ``rank``'s spare file waits: a retired snapshot's rank file, whose pages its next snapshot
    overwrites instead of allocating fresh ones (a copy into fresh tmpfs pages costs allocation and zeroing too)."""
    return os.path.join(mem, SPARE_DIR, directory.rank_file_name(rank))


def keep_spares(retired_path: str, mem: str, ranks: list[int]) -> int:
    """Move the rank files of ``ranks`` out of a retired snapshot into the spare directory (where no spare of that
    rank waits already); returns how many moved. The rest of the snapshot is deleted as before."""
    moved = 0
    for r in ranks:
        src = os.path.join(retired_path, directory.rank_file_name(r))
        dst = spare_path(mem, r)
        if os.path.isfile(src) and not os.path.islink(src) and not os.path.lexists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            moved += 1
    return moved


def spare_bytes(mem: str, ranks: list[int]) -> int:
    """Bytes held by the spare files of ``ranks`` (memory their next snapshot reuses: counted as free)."""
    total = 0
    for r in ranks:
        path = spare_path(mem, r)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def drop_spares(mem: str, ranks: list[int] | None = None) -> list[str]:
    """Delete the spare files of ranks other than ``ranks`` (all of them for None): a new job or layout's ranks
    do not reuse another's, and their memory goes back."""
    d = os.path.join(mem, SPARE_DIR)
    if not os.path.isdir(d) or os.path.islink(d):
        return []
    keep = {directory.rank_file_name(r) for r in ranks or ()}
    removed = []
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if name not in keep and _SPARE_RE.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
            removed.append(path)
    if ranks is None and not os.listdir(d):
        os.rmdir(d)
    return removed


def retired(mem: str) -> list[str]:
    """Snapshots retired or replaced but not yet deleted (``iter_NNNNNNN.tenplex-old``: their deleter died)."""
    if not os.path.isdir(mem):
        return []
    return sorted(os.path.join(mem, n) for n in os.listdir(mem)
                  if n.endswith(directory.OLD_SUFFIX) and n.startswith("iter_"))


def clean(mem: str) -> list[str]:
    """Remove every snapshot (committed or left half-written) of a finished job from a memory directory."""
    removed = []
    for path in directory.partial_dirs(mem):
        if directory.remove_partial(path):
            removed.append(path)
    for path in retired(mem):
        if directory.remove_own(path, formats.is_tenplex_checkpoint):
            removed.append(path)
    for it in directory.committed_iterations(mem):
        path = snapshot_dir(mem, it)
        if directory.remove_own(path, formats.is_tenplex_checkpoint):
            removed.append(path)
    removed.extend(drop_spares(mem))
    tracker = os.path.join(mem, directory.TRACKER_FILE)
    if os.path.isfile(tracker):
        os.unlink(tracker)
        removed.append(tracker)
    return removed
