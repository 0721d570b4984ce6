"""One writer per checkpoint directory: a lease with a generation, fenced at every destructive step.

A job that writes into a directory (``--save``, a ``--tenplex-memory`` directory) holds its lease:
``DIR/tenplex-lease/gen-NNNNNNNN.json`` (versioned JSON: job id, generation, holder, token, heartbeat, ttl). The
current lease is the file of the highest generation. A new holder, or a new rendezvous round of the same job,
takes generation N+1 by ``link(2)``-ing a complete temporary file to that name: the link fails if another process
took N+1 first, which is atomic on local filesystems and on NFS alike (no ``flock``, no ``O_EXCL`` on old NFS
clients), and a reader never sees a half-written lease. Only the holder rewrites its own generation's file
(heartbeat, release), by rename.

Rules (:func:`check`, :func:`take`): another job's lease is refused while its holder lives (heartbeat younger
than its ttl, and, on this host, its process alive); a gone holder's lease is taken over, at once with
``take_over``; the same job (its identity: ``job_identity.py``) always takes the next generation (an elastic restart
never waits). The leases a job holds are a :class:`LeaseSet` its Checkpointer owns (no registry in the module):
it renews them from a heartbeat thread of its own, and its :meth:`LeaseSet.fence`, passed down to every writer and
called before a commit, retention or the removal of a partial save, stops a writer whose generation is no longer
the newest: a split rendezvous or a second launch on the same directory leaves one writer, the newest.
A writer checks, then acts: between the two a newer holder can start; its own first destructive step comes after
its own start-up, which makes that window (milliseconds here) much shorter than any save.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.flags import FlagError
from tenplex_megatron.plan.versioned import VersionedFormat
from tenplex_megatron.storage.bounded import read_capped
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.files import CheckpointFileError, fsync_dir

log = tlog.get("lease")

LEASE_DIR = "tenplex-lease"
FORMAT = "tenplex-lease"
VERSION = 1
DEFAULT_TTL = 15.0  # seconds without a heartbeat after which another job may take a lease over
HEARTBEATS_PER_TTL = 5
_GEN_RE = re.compile(r"gen-([0-9]{8,})\.json")
LEASE_MAX_BYTES = 64 * 1024  # a lease file is a few hundred bytes
_KEEP_OLD = 1  # older generations' files kept (the one before the newest: what it took over, for the record)
_NOT_ATOMIC = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK})


class LeaseError(CheckpointFileError):
    """The directory's lease refuses this writer (another live job holds it, or the lease file is unusable)."""


class FencedError(LeaseError):
    """A newer generation owns the directory: this writer must neither commit nor delete anything there."""


LEASE_FORMAT = VersionedFormat(f"{FORMAT} file", "version", (VERSION,), LeaseError, name=FORMAT,
                               version_label="lease format version")


@dataclass(frozen=True)
class Lease:
    """One generation's lease on a directory, as its file records it."""

    directory: str
    job: str
    generation: int
    holder: str  # host:pid of the process that took it
    token: str  # unique to this taking
    heartbeat: float  # time.time() of the last renewal
    ttl: float
    released: bool = False

    @property
    def path(self) -> str:
        return gen_path(self.directory, self.generation)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "job": self.job, "generation": self.generation,
                "holder": self.holder, "token": self.token, "heartbeat": self.heartbeat, "ttl": self.ttl,
                "released": self.released}

    def describe(self) -> str:
        return f"job {self.job!r} (generation {self.generation}, holder {self.holder})"

    def gone(self, now: float) -> bool:
        """Whether its holder is gone: released, heartbeat older than the ttl, or a dead process on this host."""
        if self.released or now - self.heartbeat > self.ttl:
            return True
        host, _, pid = self.holder.rpartition(":")
        if host != socket.gethostname() or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def lease_dir(directory: str) -> str:
    return os.path.join(directory, LEASE_DIR)


def gen_path(directory: str, generation: int) -> str:
    return os.path.join(lease_dir(directory), f"gen-{generation:08d}.json")


def _parse(directory: str, path: str, text: str) -> Lease:
    """A lease file's content, checked: refused naming the file when malformed or of a future format."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise LeaseError(f"{path}: malformed lease file ({e}); remove it if no job writes into {directory}") from None
    LEASE_FORMAT.check(d, path)
    try:
        return Lease(directory, str(d["job"]), int(d["generation"]), str(d["holder"]), str(d["token"]),
                     float(d["heartbeat"]), float(d["ttl"]), bool(d.get("released", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise LeaseError(f"{path}: malformed lease file (field {e})") from None


def generations(directory: str) -> list[int]:
    """The generations whose lease files exist (ascending)."""
    try:
        names = os.listdir(lease_dir(directory))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _GEN_RE.fullmatch(n)))


def current(directory: str) -> Lease | None:
    """The newest generation's lease of ``directory``, None where none was ever taken."""
    for g in reversed(generations(directory)):
        path = gen_path(directory, g)
        try:  # bounded like a checkpoint's own small files: a FIFO, device or giant in its place is refused
            text = read_capped(path, LEASE_MAX_BYTES).decode("utf-8", errors="replace")
        except FileNotFoundError:  # pruned meanwhile by a newer holder
            continue
        except CheckpointFileError as e:
            raise LeaseError(f"{e}; remove it if no job writes into {directory}") from None
        return _parse(directory, path, text)
    return None


#: how a refused job is told to proceed, in the words of its front door: (another directory, take over)
FLAG_REMEDY = ("Give this job another --save", "pass --tenplex-take-over")
API_REMEDY = ("Give save_checkpoint another save_dir", "pass take_over=True")


def check(directory: str, job: str, take_over: bool = False, now: float | None = None, *,
          remedy: tuple[str, str] = FLAG_REMEDY) -> Lease | None:
    """Refuse (:class:`LeaseError`) when another job's holder lives; read only. Returns the current lease.
    ``remedy``: the advice in the refusal, as the caller's users spell it (flags, or the Python API)."""
    cur = current(directory)
    if cur is None or cur.job == job or take_over or cur.gone(time.time() if now is None else now):
        return cur
    age = (time.time() if now is None else now) - cur.heartbeat
    raise LeaseError(
        f"{directory} is held by {cur.describe()}, heartbeat {age:.1f} s ago (expires after {cur.ttl:g} s): two "
        f"jobs must not write one checkpoint directory. {remedy[0]}, or, if that job is gone, "
        f"wait {max(cur.ttl - age, 0):.0f} s or {remedy[1]}")


#: a writer's fence: called with a directory before each destructive step there (:meth:`LeaseSet.fence`)
Fence = Callable[[str], None]


def no_fence(directory: str) -> None:
    """The fence of a writer that holds no lease (a library user's save, a CLI clean-up): nothing to check."""


def _key(directory: str) -> str:
    return os.path.realpath(directory)


def _write(lease: Lease, path: str) -> None:
    with open(path, "w") as f:
        json.dump(lease.to_json(), f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def take(directory: str, job: str, ttl: float = DEFAULT_TTL, take_over: bool = False, *,
         remedy: tuple[str, str] = FLAG_REMEDY, holder_pid: int | None = None) -> Lease:
    """Take the next generation of ``directory``'s lease for ``job`` (refused as :func:`check` says) and prune older
    generations' files; the caller holds it (:class:`LeaseSet`). ``holder_pid``: the process whose life the lease's
    liveness follows (default this one; a launcher that outlives its ranks, for a job whose ranks may die while the
    others continue in place)."""
    if ttl <= 0:
        raise FlagError(f"--tenplex-lease-ttl must be > 0 seconds, got {ttl}")
    os.makedirs(lease_dir(directory), exist_ok=True)
    holder = f"{socket.gethostname()}:{os.getpid() if holder_pid is None else holder_pid}"
    while True:
        cur = check(directory, job, take_over, remedy=remedy)
        gen = (cur.generation if cur else max(generations(directory), default=0)) + 1
        lease = Lease(os.path.abspath(directory), job, gen, holder, uuid.uuid4().hex, time.time(), float(ttl))
        if _link(lease, directory):
            break
    fsync_dir(lease_dir(directory))
    for g in generations(directory):
        if g < gen - _KEEP_OLD:
            try:
                os.unlink(gen_path(directory, g))
            except FileNotFoundError:
                pass
    if cur is not None and cur.job != job:
        log.warning("%s: took the lease over from %s", directory, cur.describe())
    return lease


def _link(lease: Lease, directory: str) -> bool:
    """Link a complete file of ``lease`` to its generation's name; False when another process took it first."""
    tmp = f"{lease.path}.{lease.token}.tmp"
    _write(lease, tmp)
    try:
        maybe_fail("lease.link", int(os.environ.get("RANK", "0") or 0))
        os.link(tmp, lease.path)
    except FileExistsError:  # another process took this generation first: look again
        return False
    except OSError as e:
        if e.errno in _NOT_ATOMIC:
            raise LeaseError(
                f"{directory}: the filesystem refuses hard links ({e.strerror}): the lease needs link(2) to "
                "be taken atomically, so two jobs could write this directory at once; save to a filesystem "
                "with hard links (local disks, NFS, Lustre, tmpfs)") from None
        raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return True


def taken(directory: str, generation: int, token: str) -> Lease:
    """The lease another process of the same job took (its ``generation`` and ``token``), for this process to hold
    too. Refused (:class:`LeaseError`, naming the file) when that generation is gone, is not the newest, or was
    taken by another taking (another token)."""
    path = gen_path(directory, generation)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise LeaseError(f"{path}: the lease generation this job took is gone (a newer holder pruned it)") from None
    mine = _parse(directory, path, text)
    newest = max(generations(directory), default=0)
    if mine.token != token or newest != generation:
        raise FencedError(f"{directory}: a newer generation owns the directory (generation {newest}; this job took "
                          f"generation {generation}): this process does not write there")
    return replace(mine, directory=os.path.abspath(directory))


def fence_generation(directory: str, generation: int, writer: str = "") -> None:
    """Before a destructive step of a writer of ``generation`` (a job's own, or a node's helper process writing
    for it): stop when a newer generation owns ``directory``."""
    newest = max(generations(directory), default=0)
    if newest == generation:
        return
    try:
        newer = current(directory)
    except LeaseError:
        newer = None
    who = newer.describe() if newer is not None else f"generation {newest}"
    raise FencedError(f"{directory}: a newer generation owns the directory ({who}); this writer "
                      f"({writer or f'generation {generation}'}) stops without committing, applying retention or "
                      "removing partial saves")


def _rewrite(lease: Lease) -> None:
    """Replace the lease's file atomically, through a temporary name no other writer uses."""
    tmp = f"{lease.path}.{uuid.uuid4().hex}.tmp"
    _write(lease, tmp)
    os.replace(tmp, lease.path)


def renew(lease: Lease) -> Lease:
    """Rewrite this generation's file with a fresh heartbeat (only while it is the newest)."""
    if max(generations(lease.directory), default=0) != lease.generation:
        return lease
    new = replace(lease, heartbeat=time.time())
    _rewrite(new)
    return new


class LeaseSet:
    """The leases one job holds in this process, renewed by a heartbeat thread of its own while any is held, and
    the fence of its writers: a job's :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` owns one,
    and passes :meth:`fence` to what commits, applies retention or removes partial saves in its directories."""

    def __init__(self) -> None:
        self._held: dict[str, Lease] = {}  # real path of a directory -> the lease on it
        self._lock = threading.Lock()
        #: one rewrite of a held lease's file at a time, taken before _lock: the heartbeat's renewal and a release
        #: must not interleave (a renewal after the release would mark the lease live again)
        self._write = threading.Lock()
        self._beat: tuple[int, threading.Thread, threading.Event] | None = None  # pid, thread, its stop

    def acquire(self, directory: str, job: str, ttl: float = DEFAULT_TTL, take_over: bool = False, *,
                remedy: tuple[str, str] = FLAG_REMEDY, holder_pid: int | None = None) -> Lease:
        """Take the next generation of ``directory``'s lease (:func:`take`) and hold it here."""
        return self._hold(take(directory, job, ttl, take_over, remedy=remedy, holder_pid=holder_pid))

    def adopt(self, directory: str, generation: int, token: str) -> Lease:
        """Hold here too the lease another process of the same job took (:func:`taken`): no new generation, so the
        job's other holders are not fenced; this heartbeat renews it as well, so it stays live while any holder
        lives."""
        return self._hold(taken(directory, generation, token))

    def _hold(self, lease: Lease) -> Lease:
        with self._lock:
            self._held[_key(lease.directory)] = lease
        self._start_heartbeat()
        return lease

    def held(self, directory: str) -> Lease | None:
        """This set's lease on ``directory``, if it holds one."""
        with self._lock:
            return self._held.get(_key(directory))

    @property
    def directories(self) -> tuple[str, ...]:
        """The directories whose leases this set holds."""
        with self._lock:
            return tuple(lease.directory for lease in self._held.values())

    def fence(self, directory: str) -> None:
        """Before a commit, retention or a partial save's removal: stop (:class:`FencedError`) when this set holds
        ``directory``'s lease but a newer generation exists. A directory it holds no lease on: no check."""
        mine = self.held(directory)
        if mine is not None:
            fence_generation(directory, mine.generation, mine.describe())

    def release(self, directory: str) -> None:
        """Give ``directory``'s lease back (a clean end): the next job, of any id, takes it over at once."""
        with self._write:
            with self._lock:
                mine = self._held.pop(_key(directory), None)
            if mine is None or max(generations(directory), default=0) != mine.generation:
                return
            _rewrite(replace(mine, heartbeat=time.time(), released=True))

    def close(self, timeout: float = 10.0) -> bool:
        """Release every lease held and end the heartbeat thread; returns whether it ended."""
        for d in self.directories:
            self.release(d)
        return self.stop_heartbeat_when_idle(timeout)

    def __enter__(self) -> LeaseSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_heartbeat(self) -> None:
        """Start this set's heartbeat thread, once per process (a forked child starts its own)."""
        with self._lock:
            if self._beat is not None and self._beat[0] == os.getpid():
                return
            stop = threading.Event()
            t = threading.Thread(target=self._run, args=(stop,), name="tenplex-lease-heartbeat", daemon=True)
            self._beat = (os.getpid(), t, stop)
        t.start()

    def _run(self, stop: threading.Event) -> None:
        """The heartbeat: renew every held lease ``HEARTBEATS_PER_TTL`` times per ttl, until ``stop`` is set."""
        while True:
            with self._lock:
                leases = list(self._held.items())
            period = min((lease.ttl for _, lease in leases), default=DEFAULT_TTL) / HEARTBEATS_PER_TTL
            if stop.wait(period):
                return
            self._beat_once(leases)

    def _beat_once(self, leases: list[tuple[str, Lease]]) -> None:
        """One heartbeat: renew each of ``leases`` (a list made before the sleep) still held as it was."""
        for key, lease in leases:
            with self._write:
                with self._lock:
                    if self._held.get(key) is not lease:  # released (or taken again) since the list was made
                        continue
                try:
                    new = renew(lease)
                except OSError as e:  # a full or vanished filesystem: the lease may expire; the fence still holds
                    log.warning("%s: lease heartbeat failed: %s", lease.directory, e)
                    continue
                with self._lock:
                    if self._held.get(key) is lease:
                        self._held[key] = new

    def stop_heartbeat_when_idle(self, timeout: float = 10.0) -> bool:
        """End the heartbeat thread when no lease is held (the next :meth:`acquire` starts a new one); returns
        whether no heartbeat of this set runs in this process."""
        with self._lock:
            if self._held:
                return False
            beat, self._beat = self._beat, None
        if beat is None or beat[0] != os.getpid():
            return True
        _, thread, stop = beat
        stop.set()
        thread.join(timeout)
        return not thread.is_alive()
