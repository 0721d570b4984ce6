"""megatron-core 0.16.1's grad-buffer layout under the distributed optimizer, as pure arithmetic.

``_ParamAndGradBuffer`` lays a model chunk's parameters end to end in reverse
order, each starting at a multiple of 64 elements; a shared-embedding
parameter gets a bucket of its own; every bucket's end is padded to a
multiple of lcm(DP, 128) (``pad_buckets_for_high_nccl_busbw``: lcm(DP, 128,
2^16)); DP rank r owns elements ``[r L, (r + 1) L)`` of each bucket (L = bucket
size / DP). The ``dp_reshardable`` checkpoint saves, per bucket, each DP rank's
pieces of each parameter plus the gaps between them (not the end padding), as
flat ranges of one tensor of the bucket's unpadded size. This module computes
those pieces, so a checkpoint's stored chunks can be checked byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.errors import TenplexError


@dataclass(frozen=True)
class BufferParam:
    """One parameter as the buffer sees it: a name, its element count, whether it is the shared embedding."""

    name: str
    numel: int
    shared_embedding: bool = False


@dataclass(frozen=True)
class Piece:
    """A flat range ``[start, stop)`` of a bucket held by one DP rank: part of ``param`` (``param_start``: the
    parameter's first element in the bucket) or padding (``param`` None)."""

    start: int
    stop: int
    dp_rank: int
    param: str | None = None
    param_start: int = 0


@dataclass(frozen=True)
class Bucket:
    """A bucket: its size with and without the end padding, and the saved pieces in bucket order."""

    numel: int
    numel_unpadded: int
    params: tuple[tuple[str, int, int], ...]  # (name, start, stop) in the bucket
    pieces: tuple[Piece, ...]


class BucketArgsError(TenplexError, ValueError):
    """Saved args whose DDP bucketing the layout here cannot reproduce."""


def saved_bucketing(args: Any, dp: int, pp_rank: int) -> tuple[int | None, bool]:
    """(bucket size, ``pad_buckets_for_high_nccl_busbw``) of megatron-core's DDP on pipeline rank ``pp_rank``, from
    Megatron-LM's saved ``args`` (a Namespace or a dict; None: a job that saved none, unbucketed).

    Buckets exist only with ``overlap_grad_reduce``, and only on the first pipeline rank (megatron-core turns them
    off on the others); their size is ``ddp_bucket_size``, else megatron-core's default max(40M, 1M x DP)."""

    def get(name: str, default: Any = None) -> Any:
        return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)

    pad = bool(get("ddp_pad_buckets_for_high_nccl_busbw", False))
    if args is None or not get("overlap_grad_reduce", False) or pp_rank > 0:
        return None, pad
    if get("ddp_num_buckets"):
        raise BucketArgsError(f"ddp_num_buckets={get('ddp_num_buckets')}: buckets sized from the parameter count are "
                              "not reproduced yet (save with --ddp-bucket-size)")
    size = get("ddp_bucket_size")
    return (int(size) if size else max(40_000_000, 1_000_000 * dp)), pad


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def bucket_layout(params: list[BufferParam], dp: int, bucket_size: int | None = None,
                  high_nccl_busbw: bool = False) -> list[Bucket]:
    """The buckets of one buffer of ``params`` (in ``module.parameters()`` order) at DP size ``dp``."""
    divisor = math.lcm(dp, 128, 2**16) if high_nccl_busbw else math.lcm(dp, 128)
    buckets: list[list[tuple[str, int, int]]] = []
    bounds: list[tuple[int, int, int]] = []  # (start, end, unpadded end)
    start = bucket_start = 0
    current: list[tuple[str, int, int]] = []

    def close(end: int) -> int:
        nonlocal bucket_start, current
        padded = _pad(end, divisor)
        bounds.append((bucket_start, padded, end))
        buckets.append(current)
        bucket_start, current = padded, []
        return padded

    end = 0
    for p in reversed(params):
        start = _pad(start, 64)
        if p.shared_embedding and current:
            start = close(start)
        end = start + p.numel
        current.append((p.name, start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or p.shared_embedding:
            start = close(end)
        else:
            start = end
    if current:
        close(end)
    out = []
    for (b0, b1, unpadded), members in zip(bounds, buckets):
        local = [(n, s - b0, e - b0) for n, s, e in members]
        out.append(Bucket(b1 - b0, unpadded - b0, tuple(local), tuple(_pieces(local, b1 - b0, unpadded - b0, dp))))
    return out


def _pieces(params: list[tuple[str, int, int]], numel: int, unpadded: int, dp: int) -> list[Piece]:
    """``sharded_param_state_dp_reshardable``'s pieces: per DP rank its parameter ranges, and the gaps between them
    (at the front, between, at the end) unless the gap starts at or past the unpadded end."""
    shard = numel // dp
    out: list[Piece] = []
    for r in range(dp):
        lo, hi = r * shard, (r + 1) * shard
        mine = [(max(s, lo) - lo, min(e, hi) - lo, n, s) for n, s, e in params if max(s, lo) < min(e, hi)]
        at = 0
        for a, b, name, s in mine:
            if a != at and lo + at < unpadded:
                out.append(Piece(lo + at, lo + a, r))
            out.append(Piece(lo + a, lo + b, r, name, s))
            at = b
        if mine and at != shard and lo + at < unpadded:
            out.append(Piece(lo + at, hi, r))
    return out
