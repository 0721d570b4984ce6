"""Bounded opening of the files a checkpoint directory holds: regular files only, size-capped, never blocking.

A checkpoint directory is untrusted input, its small files (``metadata.json``, the tracker) included: each is
confined to the directory like a rank file (``confine.py``: a link out of it is refused), opened with
``O_NONBLOCK`` so that a FIFO cannot hang the open, checked with ``fstat`` to be a regular file (no FIFO, device,
socket or directory), and read only up to a cap (a ``/dev/zero`` or a sparse giant cannot take the memory). Pure:
no torch.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from tenplex_megatron.flags import FlagError
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.files import CheckpointFileError

METADATA_MAX_ENV = "TENPLEX_METADATA_MAX_MB"
METADATA_MAX_MB = 256  # a 100,000-chunk metadata.json is about 30 MB


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file; else :class:`CheckpointFileError` naming it and what it
    is. Never blocks: a FIFO is opened with ``O_NONBLOCK`` and refused. ``FileNotFoundError`` when it is missing."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFileError(f"{path}: is {_kind(st.st_mode)}, not a regular file; a checkpoint holds "
                                      "regular files only")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str) -> None:
    """Raise :class:`CheckpointFileError` unless ``path`` (followed through links) is a regular file; a missing
    file raises ``FileNotFoundError``. Looks at the file without opening it."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointFileError(f"{path}: is {_kind(st.st_mode)}, not a regular file; a checkpoint holds regular "
                                  "files only")


def metadata_cap() -> int:
    """The most bytes a ``metadata.json`` may have (``TENPLEX_METADATA_MAX_MB``, default 256)."""
    raw = os.environ.get(METADATA_MAX_ENV, "")
    try:
        mb = float(raw) if raw else METADATA_MAX_MB
    except ValueError:
        raise FlagError(f"{METADATA_MAX_ENV}={raw!r}: expected a size in MB") from None
    if mb <= 0:
        raise FlagError(f"{METADATA_MAX_ENV}={raw!r}: expected a size in MB above 0")
    return int(mb * 1024 * 1024)


def read_capped(path: str, cap: int, override: str | None = None) -> bytes:
    """The bytes of regular file ``path``, refused (naming the file and the cap, and ``override``: the variable that
    raises it) when it holds more than ``cap`` bytes; reads at most ``cap + 1`` bytes whatever its size claims."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(cap + 1) if size <= cap else b""
    if size > cap or len(data) > cap:
        how = f" (set {override} to raise it)" if override else ""
        raise CheckpointFileError(f"{path}: {max(size, len(data))} bytes, over the cap of {cap} bytes for this "
                                  f"file{how}")
    return data


def read_checkpoint_file(ckpt_dir: str, name: str, cap: int, override: str | None = None) -> bytes:
    """File ``name`` of checkpoint directory ``ckpt_dir``: confined to it (no link out), a regular file, at most
    ``cap`` bytes. ``FileNotFoundError`` when it is missing."""
    return read_capped(confine(ckpt_dir, name, "the checkpoint format"), cap, override)


__all__ = ["METADATA_MAX_ENV", "check_regular", "metadata_cap", "open_regular", "read_capped", "read_checkpoint_file"]
