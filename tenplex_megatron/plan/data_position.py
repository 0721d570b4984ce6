"""Data-position arithmetic: which global samples each DP rank reads. Pure Python.

Global batch ``b`` always holds samples ``[b*G, (b+1)*G)`` (G = global batch
size), whatever the DP size; DP rank ``r`` reads the contiguous ``r``-th share,
cut into micro-batches. A DP change only changes the number of micro-batches
per step (VirtualFlow's principle), never which samples a step sees.
"""

from __future__ import annotations

from tenplex_megatron.errors import TenplexError


class DataPositionError(TenplexError, ValueError):
    """Batch sizes, a DP rank or a consumed-samples count that do not divide into steps; the message names them."""


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step; raises naming valid micro-batch sizes when it does not divide."""
    if micro_batch_size < 1 or dp_size < 1:
        raise DataPositionError("micro batch size and DP size must be >= 1")
    if global_batch_size % (micro_batch_size * dp_size):
        per_dp = global_batch_size / dp_size
        valid = [m for m in range(1, global_batch_size + 1) if global_batch_size % (m * dp_size) == 0]
        raise DataPositionError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size x DP = "
            f"{micro_batch_size} x {dp_size}; with DP={dp_size} valid micro-batch sizes are {valid}"
            + ("" if valid else f" (none: {global_batch_size} / {dp_size} = {per_dp})")
        )
    return global_batch_size // (micro_batch_size * dp_size)


def microbatch_sample_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int
) -> list[list[int]]:
    """Global sample indices of each of this DP rank's micro-batches in the step at ``consumed_samples``."""
    if consumed_samples % global_batch_size:
        raise DataPositionError(
            f"consumed samples {consumed_samples} is not a multiple of the global batch size {global_batch_size}"
        )
    return batch_sample_indices(consumed_samples, global_batch_size, micro_batch_size, dp_size, dp_rank)


def batch_sample_indices(start: int, batch_size: int, micro_batch_size: int, dp_size: int,
                         dp_rank: int) -> list[list[int]]:
    """This DP rank's micro-batches of the global batch ``[start, start + batch_size)``: its contiguous share, whatever
    ``start`` (a batch-size ramp starts batches anywhere)."""
    n = num_microbatches(batch_size, micro_batch_size, dp_size)
    if not 0 <= dp_rank < dp_size:  # else it would silently read another step's samples
        raise DataPositionError(f"DP rank {dp_rank} is out of range for DP size {dp_size} (valid: 0 to {dp_size - 1})")
    first = start + dp_rank * (batch_size // dp_size)
    return [list(range(first + m * micro_batch_size, first + (m + 1) * micro_batch_size)) for m in range(n)]
