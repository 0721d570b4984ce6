"""A built-in, learnable, DP-independent token stream for tests and the demo.

Sample ``i`` is an arithmetic token sequence whose start and stride come from a
generator seeded by ``(seed, i)``: the model can learn it, and every sample is
a pure function of its global index, so the order never depends on DP.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tenplex_megatron.plan.data_position import microbatch_sample_indices


def sample(index: int, seq_length: int, vocab_size: int, seed: int = 1234) -> torch.Tensor:
    """Tokens (``seq_length + 1`` of them) of global sample ``index``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(0, vocab_size, (1,), generator=g))
    stride = int(torch.randint(1, 8, (1,), generator=g))
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def batch_from_indices(indices: list[int], seq_length: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A megatron GPT micro-batch (tokens, labels, loss mask, positions) from global sample indices."""
    data = torch.stack([sample(i, seq_length, vocab_size, seed) for i in indices])
    tokens = data[:, :-1].contiguous()
    labels = data[:, 1:].contiguous()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
        "position_ids": torch.arange(seq_length).unsqueeze(0).expand_as(tokens).contiguous(),
    }


def microbatches(
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    seq_length: int,
    vocab_size: int,
    seed: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``."""
    for indices in microbatch_sample_indices(consumed_samples, global_batch_size, micro_batch_size, dp_size, dp_rank):
        yield batch_from_indices(indices, seq_length, vocab_size, seed)
