"""File primitives of the checkpoint format that need no torch: the error types and fsync helpers."""

from __future__ import annotations

import os

from tenplex_megatron.errors import TenplexError


class CheckpointFileError(TenplexError, RuntimeError):
    """A checkpoint file that is missing, truncated or malformed; the message names it."""


class CheckpointNotFoundError(CheckpointFileError, FileNotFoundError):
    """A checkpoint, or a file one needs, that is not where it is looked for; the message names the path."""


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
