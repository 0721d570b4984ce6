"""A real etcd server on loopback ports for torchrun's ``etcd-v2`` rendezvous (the fault benchmark and the etcd
test share it): Debian's etcd-server (3.4) started with ``--enable-v2``, the API the backend speaks."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

from benchmarks.kit.agents import free_port


class EtcdError(RuntimeError):
    """No etcd on PATH, or it did not answer."""


def start_etcd(data: str, timeout: float = 60) -> tuple[subprocess.Popen, int]:
    """Start etcd with its data under ``data`` (its output in ``data + '.log'``); return it and its client port once
    it answers. The caller kills it (it runs in a session of its own)."""
    exe = shutil.which("etcd")
    if exe is None:
        raise EtcdError("no etcd on PATH (`make etcd` installs Debian's etcd-server)")
    client, peer = free_port(), free_port()
    p = subprocess.Popen([exe, "--enable-v2", "--name", "default", "--data-dir", data,
                          "--listen-client-urls", f"http://127.0.0.1:{client}",
                          "--advertise-client-urls", f"http://127.0.0.1:{client}",
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                         stdout=open(data + ".log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/v2/keys", timeout=1):
                return p, client
        except OSError:
            time.sleep(0.2)
    p.kill()
    with open(data + ".log") as f:
        raise EtcdError(f"etcd did not answer on port {client}: {f.read()[-2000:]}")
