"""Ending a survivor's pending gloo operations on a fault, so that it restarts in place at once.

NVRx's abort destroys the process groups, but a gloo operation already waiting (a receive whose sender is waiting
on the dead rank, a send to it) does not end with them: it returns only at the gloo timeout, which a survivor then
waits out before its next call (NCCL's communicators have an abort; gloo's ``abort()`` leaves pending operations
as they are). Shutting the connections of this process's gloo pairs down ends every such wait at once with gloo's
own "connection closed" error. The job's stores (the launcher's, NVRx's) are left alone: the next call needs them.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

import psutil

from tenplex_megatron import log as tlog

log = tlog.get("inprocess")


def _socket_inodes(pid: int | str) -> dict[int, str]:
    """The sockets ``pid`` holds open: descriptor -> ``socket:[inode]`` (empty where /proc cannot be read)."""
    base = f"/proc/{pid}/fd"
    out = {}
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(os.path.join(base, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def peer_connections(store_ports: Iterable[int]) -> list[int]:
    """The file descriptors of this process's established TCP connections that neither reach nor serve a store port
    nor are shared with its parent (one forked from its launcher inherits the launcher's own connections): the gloo
    pairs' connections, in a rank whose only other TCP peers are the stores."""
    keep = set(store_ports)
    proc = psutil.Process()
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    mine = _socket_inodes("self")
    inherited = set(_socket_inodes(os.getppid()).values())
    return [c.fd for c in conns
            if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and c.raddr
            and c.raddr.port not in keep and c.laddr.port not in keep and mine.get(c.fd) not in inherited]


def shut_down(fds: Iterable[int]) -> int:
    """Shut every connection in ``fds`` down both ways (the descriptors stay open: gloo closes its own); how many."""
    n = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            finally:
                s.close()
    return n


def end_pending_gloo(store_ports: Iterable[int]) -> int:
    """In a job whose default process group is gloo, shut down this process's connections but the stores'; how
    many were (none with NCCL: its communicators' abort ends their waits, and its own sockets are left alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"):
        return 0
    n = shut_down(peer_connections(store_ports))
    log.info("in place: %d gloo connection(s) shut down to end pending operations", n)
    return n
