"""The root of the package's errors: every error tenplex-megatron raises is a :class:`TenplexError`.

A caller catches the plugin's errors as one (``except TenplexError``); each class keeps its
other bases (``ValueError``, ``RuntimeError``, ``ImportError``) so narrower ``except`` clauses still work.
A failure that travels (between ranks, or from a node's helper process) travels as a :class:`Failure`
record whose ``kind`` a reader tests, never as a string whose prefix it parses.
Pure Python, imports nothing of the package, so every layer (``plan/`` included) can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class TenplexError(Exception):
    """An error raised by tenplex-megatron; the message names the file, tensor or flag at fault."""

    #: the stable name a failure of this class travels under (:class:`Failure`): the class's own, never inherited,
    #: its class name unless the class body sets one, so a subclass is told apart from its base on another rank
    kind: ClassVar[str] = "TenplexError"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:
            cls.kind = cls.__name__


def kind_of(error: BaseException) -> str:
    """The kind ``error`` travels under: a :class:`TenplexError`'s ``kind``, else its class name
    (``FileNotFoundError``, ``KeyboardInterrupt``)."""
    return error.kind if isinstance(error, TenplexError) else type(error).__name__


@dataclass(frozen=True)
class Failure:
    """A failure as data, to send to other ranks or processes: its kind (:func:`kind_of`), the exception's class
    name and message; ``str()`` gives the words users read (``"OSError: [Errno 28] ..."``)."""

    kind: str
    message: str
    type_name: str = ""  # empty for a failure that is no exception's (a helper process that died)

    @classmethod
    def of(cls, error: BaseException, limit: int | None = None) -> Failure:
        """``error`` as a record; ``limit``: the most characters of its words, the rest cut to `` [...]``."""
        name, message = type(error).__name__, str(error)
        if limit is not None and len(name) + 2 + len(message) > limit:
            message = message[: max(0, limit - len(name) - 2)] + " [...]"
        return cls(kind_of(error), message, name)

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.type_name else self.message

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message, "type": self.type_name}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        return cls(str(d["kind"]), str(d["message"]), str(d.get("type", "")))
