"""The messages between a training process and its node's helper process: one versioned JSON object a line.

The training process sends requests on the helper's stdin (:class:`Persist`, :class:`Replicate`,
:class:`Remove`, :class:`Hurry`); the helper answers each but ``Hurry`` with one :class:`Reply` on its stdout.
Every line carries ``format`` and ``version``; a line that is not a known message of this version is refused
(:class:`ProtocolError`, answered as an error naming it), never guessed at. A reply's error is a
:class:`~tenplex_megatron.errors.Failure` record (kind, type, message), so the job tests its kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from tenplex_megatron.errors import Failure, TenplexError
from tenplex_megatron.plan.versioned import VersionedFormat

FORMAT = "tenplex-memory-helper"
VERSION = 2  # 2: a reply's error is a Failure record, not its words
HELPER_EXITED = "helper_exited"  # the kind of the failure the job records for a helper that died (no exception's)


class ProtocolError(TenplexError, ValueError):
    """A line that is not a message of this protocol (unknown op, other version, missing or mistyped field)."""


MESSAGE_FORMAT = VersionedFormat(f"{FORMAT} message", "version", (VERSION,), ProtocolError, name=FORMAT,
                                 version_label=f"{FORMAT} version")


@dataclass(frozen=True)
class Copy:
    """One file of a persist: ``src`` (in node memory) to ``dst`` (the durable checkpoint's staging directory)."""

    src: str
    dst: str


@dataclass(frozen=True)
class Send:
    """A snapshot file this node sends to the helper of node ``peer`` (its index in the helpers' group) as ``tag``."""

    path: str
    peer: int
    tag: int


@dataclass(frozen=True)
class Receive:
    """A replica this node receives from node ``peer`` as ``tag``: ``size`` bytes into ``path``, over the pages of
    ``spare`` (a retired replica of the same rank file) where one waits."""

    peer: int
    size: int
    path: str
    tag: int
    spare: str | None = None


@dataclass(frozen=True)
class Persist:
    """Copy a snapshot's own files to durable storage, each fsynced (the job commits it once all nodes answered).
    ``lease``: the durable directory and the generation of the job's lease on it, checked before each file (a
    helper of a fenced job stops writing where the newer holder saves)."""

    op: ClassVar[str] = "persist"
    iteration: int
    copies: tuple[Copy, ...]
    lease: tuple[str, int] | None = None


@dataclass(frozen=True)
class Replicate:
    """Send this node's files of a snapshot and receive its replicas of others', at most ``rate`` bytes/s (0: all
    at once)."""

    op: ClassVar[str] = "replicate"
    iteration: int
    sends: tuple[Send, ...]
    recvs: tuple[Receive, ...]
    rate: float = 0.0


@dataclass(frozen=True)
class Remove:
    """Delete retired snapshot directories (already renamed out of the listing)."""

    op: ClassVar[str] = "remove"
    paths: tuple[str, ...]
    iteration: int = 0


@dataclass(frozen=True)
class Hurry:
    """From now on send as fast as possible (the job is stopping); no reply."""

    op: ClassVar[str] = "hurry"
    iteration: int = 0


Request = Persist | Replicate | Remove | Hurry


@dataclass(frozen=True)
class Reply:
    """The helper's answer to one request: the bytes it handled, or the failure that ended it."""

    op: str
    iteration: int
    bytes: int = 0
    error: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _line(op: str, body: dict[str, Any]) -> bytes:
    return (json.dumps({"format": FORMAT, "version": VERSION, "op": op, **body}) + "\n").encode()


def encode(msg: Request | Reply) -> bytes:
    """One message as its line (a newline-terminated JSON object)."""
    if isinstance(msg, Reply):
        error = None if msg.error is None else msg.error.to_json()
        return _line(msg.op, {"iteration": msg.iteration, "bytes": msg.bytes, "error": error})
    body: dict[str, Any] = {"iteration": msg.iteration}
    if isinstance(msg, Persist):
        body["copies"] = [{"src": c.src, "dst": c.dst} for c in msg.copies]
        body["lease"] = {"directory": msg.lease[0], "generation": msg.lease[1]} if msg.lease else None
    elif isinstance(msg, Replicate):
        body["sends"] = [{"path": s.path, "peer": s.peer, "tag": s.tag} for s in msg.sends]
        body["recvs"] = [{"peer": r.peer, "size": r.size, "path": r.path, "tag": r.tag, "spare": r.spare}
                         for r in msg.recvs]
        body["rate"] = msg.rate
    elif isinstance(msg, Remove):
        body["paths"] = list(msg.paths)
    return _line(msg.op, body)


def _parse(line: bytes | str) -> dict[str, Any]:
    try:
        d = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not JSON ({e}): {line[:80]!r}") from None
    return MESSAGE_FORMAT.check(d, f"line {line[:80]!r}")


def _field(d: dict[str, Any], name: str, kind: type) -> Any:
    v = d.get(name)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ProtocolError(f"{d.get('op')!r} message: field {name!r} must be {kind.__name__}, got {v!r}")
    return v


def _items(d: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = _field(d, name, list)
    if not all(isinstance(x, dict) for x in got):
        raise ProtocolError(f"{d.get('op')!r} message: field {name!r} must be a list of objects")
    return got


def decode_request(line: bytes | str) -> Request:
    """A request line as its message; :class:`ProtocolError` naming what is wrong otherwise."""
    d = _parse(line)
    op, it = d.get("op"), _field(d, "iteration", int)
    if op == Persist.op:
        lease = d.get("lease")
        if lease is not None and not isinstance(lease, dict):
            raise ProtocolError(f"'persist' message: field 'lease' must be an object or null, got {lease!r}")
        held = (_field(lease, "directory", str), _field(lease, "generation", int)) if lease is not None else None
        return Persist(it, tuple(Copy(_field(c, "src", str), _field(c, "dst", str)) for c in _items(d, "copies")),
                       held)
    if op == Replicate.op:
        sends = tuple(Send(_field(s, "path", str), _field(s, "peer", int), _field(s, "tag", int))
                      for s in _items(d, "sends"))
        recvs = tuple(Receive(_field(r, "peer", int), _field(r, "size", int), _field(r, "path", str),
                              _field(r, "tag", int), r.get("spare") if isinstance(r.get("spare"), str) else None)
                      for r in _items(d, "recvs"))
        return Replicate(it, sends, recvs, _field(d, "rate", float))
    if op == Remove.op:
        paths = _field(d, "paths", list)
        if not all(isinstance(p, str) for p in paths):
            raise ProtocolError("'remove' message: field 'paths' must be a list of strings")
        return Remove(tuple(paths), it)
    if op == Hurry.op:
        return Hurry(it)
    raise ProtocolError(f"unknown op {op!r} (known: persist, replicate, remove, hurry)")


def decode_reply(line: bytes | str) -> Reply:
    """A reply line as its message; :class:`ProtocolError` naming what is wrong otherwise."""
    d = _parse(line)
    error = d.get("error")
    if error is not None and not (isinstance(error, dict)
                                  and all(isinstance(error.get(k), str) for k in ("kind", "message", "type"))):
        raise ProtocolError(f"reply: field 'error' must be null or an object of strings kind, message and type, "
                            f"got {error!r}")
    failure = None if error is None else Failure.from_json(error)
    return Reply(_field(d, "op", str), _field(d, "iteration", int), _field(d, "bytes", int), failure)
