"""The reference trainer's output: lines printed by rank 0 (the trainer prints; the library logs).

Its own lines keep Megatron-LM's shape (``> tenplex-megatron: ...``, the iteration line); a line the library
composes (``frontdoor``'s ``describe_*``, ``loaded_line``) gets the logger's prefix, so both front doors print it
alike.
"""

from __future__ import annotations

import torch

from tenplex_megatron import log


def print0(msg: str) -> None:
    """Print ``msg`` on global rank 0 (flushed: torchrun interleaves the ranks' output)."""
    if torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def print_tenplex(msg: str) -> None:
    """Print a line of the library's on rank 0 with the logger's one prefix (``> tenplex: ``)."""
    print0(log.PREFIX + msg)
