"""Megatron's indexed datasets through megatron.core.datasets, read in a DP-independent order.

The tokenizer is byte-level (UTF-8 bytes 0-255, end-of-document 256, padding
257: vocabulary 258): it needs no download and no training. Datasets are
megatron-core's own ``GPTDataset`` built with ``BlendedMegatronDatasetBuilder``
(its shuffle is seeded by ``--seed`` and independent of DP). Sample ``i`` of the
dataset is global sample ``i``: global batch ``b`` is samples ``[b*G, (b+1)*G)``
and DP rank ``r`` reads the ``r``-th contiguous share, whatever the DP size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from tenplex_megatron.plan.data_position import microbatch_sample_indices

INDEX_HEADER = b"MMIDIDX\x00\x00"


class ByteTokenizer(MegatronLegacyTokenizer):
    """UTF-8 bytes plus end-of-document (256) and padding (257) tokens."""

    EOD = 256
    PAD = 257

    def __init__(self) -> None:
        super().__init__("byte-level")

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def detokenize(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: chr(i) for i in range(256)}

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD


def check_data_path(prefixes: list[str]) -> None:
    """Raise ValueError naming the first prefix that is not a Megatron indexed dataset (.bin + .idx)."""
    for prefix in prefixes:
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"--data-path {prefix}: not a Megatron indexed dataset ({', '.join(missing)} missing)")
        with open(idx, "rb") as f:
            if f.read(len(INDEX_HEADER)) != INDEX_HEADER:
                raise ValueError(f"--data-path {prefix}: {idx} is not a Megatron index file (bad header)")


def build_train_dataset(prefixes: list[str], split: str, seq_length: int, seed: int, num_samples: int) -> Any:
    """megatron-core's GPTDataset (train split) over the indexed datasets at ``prefixes``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_data_path(prefixes)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(prefixes), None),
        split=split,
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise ValueError(f"--data-path {' '.join(prefixes)}: the train split cannot give {num_samples} samples")
    return train


def microbatches_from_dataset(
    dataset: Any, consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``."""
    for indices in microbatch_sample_indices(consumed_samples, global_batch_size, micro_batch_size, dp_size, dp_rank):
        items = [dataset[i] for i in indices]
        yield {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
