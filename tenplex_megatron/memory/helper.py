"""The background helper of a node: a separate process that replicates and persists memory snapshots.

One per node, started by the node's first rank (:class:`Helper`), so training never waits on its work or its
GIL. It reads one request a line on stdin and answers one line on stdout, in the typed, versioned messages of
``memory/protocol.py``:

- ``Persist``: copy files of a snapshot in this node's memory to the durable checkpoint's staging directory
  (``O_DIRECT`` from the file's map where the filesystem takes it, else kernel-side: ``copy_file_range``), each
  fsynced; the job commits it (``directory.commit``) once every node's helper has answered.
- ``Replicate``: send this node's files of a snapshot to the helpers of the nodes that keep replicas and receive
  theirs, point to point over a gloo process group of the helpers alone (set up through the job's TCP store); a
  received file is written under a temporary name (over the pages of a retired replica of the same rank file,
  where one waits) and renamed into the committed snapshot directory, so a node never lists a partial replica.
  Files are sent from and received into memory maps: no copy of them in this process. With a ``rate`` (bytes/s,
  ``--tenplex-replication-rate``) the messages go in rounds of 8 MB slices, paced so that the node sends no faster.
- ``Remove``: delete retired snapshots (already renamed out of the listing), so freeing their memory does not
  stall training.
- ``Hurry`` (no answer): from now on, send as fast as possible; a paced replication under way stops pacing at its
  next round (the job is stopping: no training left to protect). Read between rounds.

A line that is not a known message is answered with an error naming it. The helper runs as a background citizen
(:func:`background_priority`: the idle CPU class, nice 19, the idle I/O class, one torch thread), blocks on its
stdin between requests, and lives and dies with the training process (:func:`bound_to_parent`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.errors import Failure
from tenplex_megatron.memory.direct_copy import ShortCopyError, copy_direct
from tenplex_megatron.memory.protocol import (
    HELPER_EXITED,
    Hurry,
    Persist,
    ProtocolError,
    Remove,
    Replicate,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode,
)
from tenplex_megatron.storage.faults import log_open, maybe_fail
from tenplex_megatron.storage.files import fsync_dir
from tenplex_megatron.storage.lease import fence_generation

log = tlog.get("memory")
CHUNK = 64 << 20
SLICE = 8 << 20  # bytes of each message per round of a paced replication (``rate``)
REPLICA_TMP = ".replica-tmp"
IOPRIO_CLASS_IDLE = 3  # linux/ioprio.h: I/O only when no other process wants the disk
_IOPRIO_SET = MappingProxyType({"x86_64": 251, "aarch64": 30})  # the ioprio_set syscall's number


BACKGROUND_NICE = 19


def idle_class() -> bool:
    """Whether the helper runs in the idle CPU class in the background (``TENPLEX_HELPER_SCHED_IDLE``, default 1)."""
    return os.environ.get("TENPLEX_HELPER_SCHED_IDLE", "1") != "0"


def background_priority() -> list[str]:
    """Make this process a background citizen: nice 19 and then the idle CPU class (``SCHED_IDLE``: a training
    thread that wakes up takes the core from it at once, where nice 19 alone can make it wait out the helper's
    slice; nice 19 is what is left where the class is refused), the idle I/O class, one torch thread; returns
    what could not be set (never fatal)."""
    missed = []
    try:
        os.nice(BACKGROUND_NICE - os.nice(0))
    except OSError as e:
        missed.append(f"nice: {e}")
    if idle_class():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as e:  # not Linux, or a seccomp profile that refuses it
            missed.append(f"sched_setscheduler SCHED_IDLE: {e}")
    nr = _IOPRIO_SET.get(os.uname().machine)
    try:
        if nr is None or ctypes.CDLL(None, use_errno=True).syscall(nr, 1, 0, IOPRIO_CLASS_IDLE << 13) != 0:
            missed.append("ioprio_set: idle class not set")
    except (OSError, AttributeError) as e:
        missed.append(f"ioprio_set: {e}")
    os.environ["OMP_NUM_THREADS"] = "1"
    return missed


PARENT_ENV = "TENPLEX_HELPER_PARENT"  # the training process's pid, set by Helper
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def bound_to_parent() -> None:
    """Live and die with the training process that started this helper: a SIGTERM or SIGINT sent to its process
    group (torchrun stopping its workers, a Ctrl-C) is the training process's to act on (it drains and closes
    this helper), and its death kills this helper (Linux: ``PR_SET_PDEATHSIG``) even where it is blocked, e.g. in
    the helpers' group rendezvous with a node that is gone."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the helper still ends when its stdin closes
        pass
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):  # the training process died before the line above
        os._exit(1)


def copy_file(src: str, dst: str, iteration: int) -> int:
    """Copy ``src`` to ``dst`` and fsync it; returns the bytes copied. ``O_DIRECT`` where the filesystem takes it
    (``direct_copy``: the device reads the snapshot's map, no page cache filled; ``TENPLEX_PERSIST_DIRECT=0``
    turns it off), else kernel-side (``copy_file_range``, ``sendfile``)."""
    log_open(src)

    def halfway() -> None:
        maybe_fail("persist.copy", int(os.environ.get("RANK", "0")), iteration)

    if os.environ.get("TENPLEX_PERSIST_DIRECT", "1") != "0":
        copied = copy_direct(src, dst, halfway)
        if copied is not None:
            return copied
    size = os.path.getsize(src)
    done = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while done < size:
            try:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), min(CHUNK, size - done))
            except OSError:
                n = os.sendfile(fo.fileno(), fi.fileno(), done, min(CHUNK, size - done))
            if n <= 0:
                raise ShortCopyError(f"{src}: short copy at byte {done} of {size}")
            done += n
            if done >= size // 2:
                halfway()
        fo.flush()
        os.fsync(fo.fileno())
    return done


def persist(req: Persist) -> int:
    """Copy the request's files to durable storage, each and their directories fsynced; returns the bytes. With the
    job's lease named, a newer generation on the directory stops it before the next file (:class:`FencedError`)."""

    def fenced() -> None:
        if req.lease is not None:
            fence_generation(req.lease[0], req.lease[1], f"the memory helper of generation {req.lease[1]}")

    total = 0
    for c in req.copies:
        fenced()
        total += copy_file(c.src, c.dst, req.iteration)
    fenced()
    for d in {os.path.dirname(c.dst) for c in req.copies}:
        fsync_dir(d)
    return total


def remove(req: Remove) -> int:
    """Delete retired snapshot directories, off the training path; returns how many went."""
    for path in req.paths:
        log_open(path)
        shutil.rmtree(path, ignore_errors=True)
    return len(req.paths)


def replicate(req: Replicate, group: Any, inbox: Inbox) -> int:
    """Send and receive a snapshot's replicas (all at once, or paced by ``req.rate`` until ``inbox`` reads a
    ``Hurry``), then store what came in."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ops: list[Any] = []
    received: list[Any] = []
    maps: list[mmap.mmap] = []  # kept open until the sends are done
    for s in req.sends:  # sent from a read-only map of the file: no copy in this process
        log_open(s.path)
        with open(s.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mm)
        t = torch.frombuffer(memoryview(mm), dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
        ops.append(dist.P2POp(dist.isend, t, s.peer, group, s.tag))
    for r in req.recvs:  # received straight into the replica's file, mapped
        tmp = r.path + REPLICA_TMP
        log_open(tmp)
        with open(tmp, "rb+" if _take_spare(r.spare, tmp) else "wb+") as f:
            f.truncate(r.size)
            mm = mmap.mmap(f.fileno(), r.size) if r.size else None
        if mm is not None:
            _populate_for_write(mm)
        buf = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
        received.append((r.path, tmp, mm, buf))
        ops.append(dist.P2POp(dist.irecv, buf, r.peer, group, r.tag))
    rate = req.rate
    if rate <= 0:
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
    else:
        _paced(ops, rate, inbox)
    total = 0
    for path, tmp, mm, buf in received:
        maybe_fail("memory.replicate", int(os.environ.get("RANK", "0")), req.iteration)
        if mm is not None:
            mm.flush()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
        total += buf.numel()
    return total


MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python 3.11's mmap does not name it


def _populate_for_write(mm: mmap.mmap) -> None:
    """Map every page of a replica's file writable in one call, before the bytes arrive: on a tmpfs with 4 KiB
    pages this costs about a fifth less CPU than the one write fault per page it replaces (0.26 against 0.31
    CPU-s for 743 MB over existing pages: ``benchmarks/pages.py``, map_write_pop against map_write). Older
    kernels refuse it: faults then."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        pass


def _take_spare(spare: str | None, tmp: str) -> bool:
    """Move the spare file ``spare`` (a retired replica of the same rank file) to ``tmp``, whose pages the
    replica is then received over (no fresh tmpfs pages to allocate and zero, none to free); False if none."""
    if not spare or not os.path.isfile(spare) or os.path.islink(spare):
        return False
    try:
        os.replace(spare, tmp)
    except FileNotFoundError:  # taken meanwhile (clean-memory, a new layout's snapshot): a fresh file then
        return False
    return True


@dataclass(frozen=True)
class Refused:
    """A line that is not a request of the protocol: answered with an error naming it, never carried out."""

    op: str
    iteration: int
    reason: str


class Inbox:
    """The requests read from stdin (one line each), readable without blocking between a paced replication's
    rounds: a ``Hurry`` there ends its pacing, and the other requests wait their turn, in order."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.queue: list[Request | Refused] = []
        self.hurry = False
        self._buf = b""

    def read(self, block: bool) -> bool:
        """Take in what has arrived (waiting for something if ``block``); False once stdin is closed."""
        if not block and not select.select([self.fd], [], [], 0)[0]:
            return True
        data = os.read(self.fd, 1 << 16)
        if not data:
            return False
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                req = decode_request(line)
            except ProtocolError as e:
                self.queue.append(_refused(line, str(e)))
                continue
            if isinstance(req, Hurry):
                self.hurry = True
            else:
                self.queue.append(req)
        return True

    def requests(self) -> Iterator[Request | Refused]:
        """The requests in order, until stdin closes."""
        while True:
            while not self.queue:
                if not self.read(block=True):
                    return
            yield self.queue.pop(0)


def _refused(line: bytes, reason: str) -> Refused:
    """What to answer a line that is not a request: its op and iteration where it names them, and why."""
    try:
        d = json.loads(line)
    except ValueError:
        d = {}
    d = d if isinstance(d, dict) else {}
    op, it = d.get("op"), d.get("iteration")
    return Refused(op if isinstance(op, str) else "?", it if isinstance(it, int) else -1, reason)


def _paced(ops: list[Any], rate: float, inbox: Inbox) -> None:
    """Carry out the sends and receives ``ops`` in rounds of one ``SLICE`` of each message, sleeping between rounds
    so that this node sends at most ``rate`` bytes per second (until a ``hurry`` arrives). Every node cuts a
    message into the same slices (the sizes are known on both sides), and a pair's messages of one tag arrive in
    order, so each node paces on its own."""
    import time

    import torch.distributed as dist

    rounds = max((-(-op.tensor.numel() // SLICE) for op in ops), default=0)
    t0, sent = time.monotonic(), 0
    for i in range(rounds):
        now = []
        for op in ops:
            part = op.tensor[i * SLICE : (i + 1) * SLICE]
            if part.numel():
                now.append(dist.P2POp(op.op, part, op.peer, op.group, op.tag))
                sent += part.numel() if op.op is dist.isend else 0
        for w in dist.batch_isend_irecv(now):
            w.wait()
        inbox.read(block=False)
        while not inbox.hurry and (ahead := sent / rate - (time.monotonic() - t0)) > 0:
            time.sleep(min(ahead, 0.05))
            inbox.read(block=False)


def _group(a: argparse.Namespace) -> Any:
    """The helpers' own gloo group (None on a single node), rendezvous through the job's TCP store."""
    if a.world <= 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=dist.PrefixStore(a.prefix, store), rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=1800))
    return dist.group.WORLD


def serve(argv: list[str] | None = None) -> None:
    """The helper's loop: one request a line until stdin closes."""
    p = argparse.ArgumentParser()
    p.add_argument("--store", default="")
    p.add_argument("--prefix", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    a = p.parse_args(argv)
    bound_to_parent()
    group = _group(a)  # its start-up (torch imported, the helpers' rendezvous) at the job's priority: once, brief
    background_priority()
    inbox = Inbox()  # stdin
    for req in inbox.requests():
        sys.stdout.buffer.write(encode(answer(req, group, inbox)))
        sys.stdout.flush()


def answer(req: Request | Refused, group: Any, inbox: Inbox) -> Reply:
    """Carry out one request (``inbox``: where a paced replication looks for a ``Hurry``); the reply says the bytes
    it handled or the error that ended it (the job decides)."""
    if isinstance(req, Refused):
        return Reply(req.op, req.iteration, error=Failure.of(ProtocolError(req.reason)))
    try:
        if isinstance(req, Persist):
            total = persist(req)
        elif isinstance(req, Remove):
            total = remove(req)
        elif isinstance(req, Replicate):
            total = replicate(req, group, inbox)
        else:
            raise ProtocolError(f"{req.op!r} has no reply")
    except Exception as e:  # noqa: BLE001 - reported to the job, which decides
        return Reply(req.op, req.iteration, error=Failure.of(e))
    return Reply(req.op, req.iteration, total)


class Helper:
    """The training side of a node's helper process: start it, send requests, poll replies without blocking.

    ``group``: (store "host:port", prefix, this node's index, number of nodes) for replication, or None.
    """

    def __init__(self, group: tuple[str, str, int, int] | None = None) -> None:
        args = [] if group is None else ["--store", group[0], "--prefix", group[1], "--rank", str(group[2]),
                                         "--world", str(group[3])]
        self.proc = subprocess.Popen([sys.executable, "-m", "tenplex_megatron.memory.helper", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
        self._buf = b""
        self.answers: dict[tuple[str, int], Reply] = {}
        self.hurried = False  # told to hurry: at the job's priority from then on

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exited(self) -> str | None:
        """How the helper process ended (None while it runs): the one wording of a helper's death, whether a poll
        reads it or the job finds the process gone."""
        code = self.proc.poll()
        return None if code is None else f"the helper process exited with status {code}"

    def request(self, req: Request) -> None:
        """Send ``req``; an earlier reply to the same op and iteration (a snapshot saved again) is forgotten."""
        assert self.proc.stdin is not None
        self.answers.pop((req.op, req.iteration), None)
        self.proc.stdin.write(encode(req))
        self.proc.stdin.flush()

    def priority(self, waited_on: bool) -> None:
        """The helper's threads at this process's priority while the job waits on it (``waited_on``: a stop, a
        blocking poll, a close), else back in the background (:func:`background_priority`). An idle-class
        process gets no CPU while the cores are busy; a job that waits on one that others starve would wait
        indefinitely. Raising it needs ``CAP_SYS_NICE``: without it the helper stays where it is (logged once)."""
        if not self.alive:
            return
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task")]
        except OSError:  # not Linux, or it has just exited
            return
        nice = os.getpriority(os.PRIO_PROCESS, 0) if waited_on else BACKGROUND_NICE
        idle = not waited_on and idle_class()
        for tid in tids:
            try:
                if waited_on:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                if idle:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except (PermissionError, AttributeError) as e:
                if not Helper._refused_logged:
                    Helper._refused_logged = True
                    log.info("the host-memory helper stays in the background while the job waits on it (%s: "
                             "raising it needs CAP_SYS_NICE)", e)
                return

    _refused_logged = False

    def hurry(self) -> None:
        """Tell the helper to stop pacing (the job is stopping) and raise it to the job's priority for the rest
        of its work (:meth:`priority`); no answer comes."""
        self.hurried = True
        self.priority(waited_on=True)
        if self.alive and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.request(Hurry())
            except BrokenPipeError:  # it died meanwhile: the next poll reports that
                pass

    def poll(self, op: str, iteration: int, timeout: float = 0.0) -> Reply | None:
        """The reply to ``op`` of ``iteration`` if there is one (waiting at most ``timeout`` s); an error if the
        helper died. A reply stays until the next request of the same kind and iteration: the job polls every
        node until all have answered, so a node that answered early answers the same again."""
        if timeout > 0 and (op, iteration) not in self.answers:  # the job waits on the helper meanwhile
            self.priority(waited_on=True)
            try:
                return self._poll(op, iteration, timeout)
            finally:
                if not self.hurried:
                    self.priority(waited_on=False)
        return self._poll(op, iteration, timeout)

    def _poll(self, op: str, iteration: int, timeout: float) -> Reply | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while (op, iteration) not in self.answers:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                self.proc.wait()
                return Reply(op, iteration, error=Failure(HELPER_EXITED, self.exited() or ""))
            self._buf += data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                got = decode_reply(line)
                self.answers[(got.op, got.iteration)] = got
        return self.answers[(op, iteration)]

    def close(self) -> None:
        """End the helper: its stdin closed, it finishes what it has under way (at the job's priority) and exits;
        killed if it has not within a minute."""
        self.priority(waited_on=True)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # its answers pipe: unclosed, it is a ResourceWarning at exit


if __name__ == "__main__":
    serve()
