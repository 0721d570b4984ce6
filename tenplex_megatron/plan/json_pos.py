"""JSON with the line and column of every value, so that errors in a user's file can name where. Pure Python.

``json`` reports where a document fails to parse (``JSONDecodeError.lineno`` and
``colno``) but not where a parsed value came from; :func:`loads_located` walks
the (already valid) text once more with the public ``raw_decode`` and records
the offset of every value by its path (keys and list indices).
"""

from __future__ import annotations

import json
from typing import Any

from tenplex_megatron.errors import TenplexError

Path = tuple[str | int, ...]


class JSONFileError(TenplexError, ValueError):
    """A JSON file that does not parse: the message names the file, line and column."""


def line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset (as ``json.JSONDecodeError`` counts them)."""
    line = text.count("\n", 0, offset) + 1
    return line, offset - text.rfind("\n", 0, offset)


def loads_located(text: str, name: str) -> tuple[Any, dict[Path, tuple[int, int]]]:
    """Parse ``text``; return the value and the (line, column) of every value by path.

    A parse error raises :class:`JSONFileError` naming ``name``, the line and the column.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise JSONFileError(f"{name}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    offsets: dict[Path, int] = {}
    _walk(text, 0, (), offsets, json.JSONDecoder())
    return value, {path: line_col(text, off) for path, off in offsets.items()}


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _walk(text: str, i: int, path: Path, out: dict[Path, int], dec: json.JSONDecoder) -> int:
    """Record the offset of the value at ``i`` and of everything inside it; return the offset after it."""
    i = _skip(text, i)
    out[path] = i
    if text[i] not in "{[":
        return dec.raw_decode(text, i)[1]
    close, n = ("}" if text[i] == "{" else "]"), 0
    i = _skip(text, i + 1)
    while text[i] != close:
        if close == "}":
            key, i = dec.raw_decode(text, i)
            i = _skip(text, i) + 1  # past the ':'
            i = _skip(text, _walk(text, i, (*path, key), out, dec))
        else:
            i = _skip(text, _walk(text, i, (*path, n), out, dec))
            n += 1
        if text[i] == ",":
            i = _skip(text, i + 1)
    return i + 1


def where(name: str, positions: dict[Path, tuple[int, int]], path: Path) -> str:
    """``name:line:col`` of the value at ``path`` (or of its nearest recorded parent)."""
    while path not in positions and path:
        path = path[:-1]
    line, col = positions.get(path, (1, 1))
    return f"{name}:{line}:{col}"
