"""The background persister of a node: a separate process that copies memory snapshots to durable storage.

One per node, started by the node's first rank (:class:`PersistHelper`). It
reads one JSON request a line on stdin (``{"iteration": N, "copies": [[src,
dst], ...]}``), copies each file at low CPU priority with ``copy_file_range``
and fsyncs it, and answers one JSON line on stdout (``{"iteration": N, "ok":
true}`` or ``{"iteration": N, "error": "..."}``). It imports nothing heavy and
never touches the training process's memory, so training does not wait on its
GIL. The copies land in the durable checkpoint's staging directory; the job
commits it (``directory.commit``) once every node's helper has answered.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any

from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.files import fsync_dir
from tenplex_megatron.storage.memory_tier import log_open

CHUNK = 64 << 20


def copy_file(src: str, dst: str, iteration: int) -> int:
    """Copy ``src`` to ``dst`` (kernel-side where possible) and fsync it; returns the bytes copied."""
    log_open(src)
    size = os.path.getsize(src)
    done = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while done < size:
            try:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), min(CHUNK, size - done))
            except OSError:
                n = os.sendfile(fo.fileno(), fi.fileno(), done, min(CHUNK, size - done))
            if n <= 0:
                raise OSError(f"{src}: short copy at byte {done} of {size}")
            done += n
            if done >= size // 2:
                maybe_fail("persist.copy", int(os.environ.get("RANK", "0")), iteration)
        fo.flush()
        os.fsync(fo.fileno())
    return done


def serve() -> None:
    """The helper's loop: one request a line until stdin closes."""
    try:
        os.nice(10)
    except OSError:
        pass
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        it = int(req["iteration"])
        try:
            total = 0
            for src, dst in req["copies"]:
                total += copy_file(src, dst, it)
            for d in {os.path.dirname(dst) for _, dst in req["copies"]}:
                fsync_dir(d)
            reply: dict[str, Any] = {"iteration": it, "ok": True, "bytes": total}
        except Exception as e:  # noqa: BLE001 - reported to the job, which decides
            reply = {"iteration": it, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class PersistHelper:
    """The training side of a node's helper process: start it, send requests, poll answers without blocking."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tenplex_megatron.storage.persist_helper"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))
        self._buf = b""
        self.answers: dict[int, dict[str, Any]] = {}

    def request(self, iteration: int, copies: list[tuple[str, str]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"iteration": iteration, "copies": copies}) + "\n").encode())
        self.proc.stdin.flush()

    def poll(self, iteration: int, timeout: float = 0.0) -> dict[str, Any] | None:
        """The answer for ``iteration`` if there is one (waiting at most ``timeout`` s); an error if the helper died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while iteration not in self.answers:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                code = self.proc.wait()
                return {"iteration": iteration, "error": f"the persist helper process exited with status {code}"}
            self._buf += data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                got = json.loads(line)
                self.answers[int(got["iteration"])] = got
        return self.answers.pop(iteration)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    serve()
