"""Confinement: a file name read from a checkpoint must name a file inside that checkpoint's directory.

Metadata, index and tracker files are untrusted input: a name in them is
accepted only as a plain relative path (no absolute path, no ``..``, no empty,
``.``, NUL, control-character or over-long component) that still lies strictly
inside the directory once every symbolic link is resolved. Every reader calls
:func:`confine` before it opens anything a checkpoint names. Pure: no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tenplex_megatron.storage.files import CheckpointFileError

NAME_MAX = 255  # bytes of one path component (Linux, most file systems)
PATH_MAX = 4096  # bytes of a whole relative name


def _why_bad(name: object) -> str | None:
    """Why ``name`` is not a plain relative name (None if it is one), without looking at the file system."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if name == "":
        return "is empty"
    if "\0" in name:
        return "contains a NUL byte"
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 text"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "contains a control character"
    if "\\" in name:
        return "contains a backslash (a path separator elsewhere)"
    if name.startswith("/"):
        return "is an absolute path"
    if len(raw) > PATH_MAX:
        return f"is {len(raw)} bytes long (at most {PATH_MAX})"
    for part in name.split("/"):
        if part == "..":
            return "has a '..' component (it would leave the directory)"
        if part in ("", "."):
            return "has an empty or '.' component"
        if len(part.encode("utf-8")) > NAME_MAX:
            return f"has a component of {len(part.encode('utf-8'))} bytes (at most {NAME_MAX})"
    return None


def _has_link(root: str, resolved: str) -> bool:
    """Whether a prefix of ``resolved`` (a path under ``root``) is still a symbolic link."""
    path = root
    for part in os.path.relpath(resolved, root).split(os.sep):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return True
    return False


def confine(ckpt_dir: str, name: str, source: str = "the metadata") -> str:
    """The absolute path of file ``name`` (read from ``source``) inside checkpoint directory ``ckpt_dir``.

    Raises :class:`CheckpointFileError` naming the checkpoint, the name and why
    when ``name`` is not a plain relative name or resolves (through symbolic
    links) to anything but a path strictly inside ``ckpt_dir``. Nothing is opened.
    """
    why = _why_bad(name)
    root = os.path.abspath(ckpt_dir)
    if why is None:
        real_root = os.path.realpath(root)
        resolved = os.path.realpath(os.path.join(real_root, name))
        if resolved == real_root or os.path.commonpath([real_root, resolved]) != real_root:
            why = f"resolves to {resolved} through a symbolic link, outside the checkpoint directory"
        elif _has_link(real_root, resolved):  # realpath leaves a link it cannot resolve (a loop) in place
            why = "goes through a symbolic link loop"
    if why is not None:
        raise CheckpointFileError(
            f"{ckpt_dir}: {source} names the file {name!r}, which {why}; "
            "a checkpoint may only name files inside its own directory"
        )
    return os.path.join(root, name)


def confine_all(ckpt_dir: str, names: Iterable[str], source: str = "the metadata") -> dict[str, str]:
    """:func:`confine` every name (each distinct one once): name -> absolute path; raises on the first bad one."""
    return {n: confine(ckpt_dir, n, source) for n in dict.fromkeys(names)}


__all__ = ["NAME_MAX", "PATH_MAX", "confine", "confine_all"]
