"""Megatron's indexed datasets through megatron.core.datasets, read in a DP-independent order.

Tokenizers (``training/tokenizer.py``): byte-level by default (vocabulary 257, UTF-8 bytes plus one
end-of-document id, no pad token: megatron-core pads a short final sample with -1, masks it out of the
loss and feeds it to the model as id 0), or Megatron-LM's ``GPT2BPETokenizer`` and
``HuggingFaceTokenizer`` from local files. Before anything starts, every dataset is checked against the
tokenizer given (``training/dataset_files.py``).

Datasets are megatron-core's own ``GPTDataset`` built with
``BlendedMegatronDatasetBuilder`` and ``GPTDatasetConfig``, as Megatron-LM's
``pretrain_gpt.py`` builds them (``--data-path`` takes prefixes or Megatron's
``WEIGHT PREFIX WEIGHT PREFIX ...`` blend, ``--split``, ``--seed``). Only the
train split is built. Its shuffle index is seeded by ``--seed`` and does not
depend on DP; the sampler here adds no shuffle of its own: sample ``i`` of the
dataset is global sample ``i``, global batch ``b`` is samples ``[b*G, (b+1)*G)``
and DP rank ``r`` reads the ``r``-th contiguous share, cut into micro-batches
(``plan.data_position``), whatever the DP size. (Megatron-LM's ``cyclic``
sampler buckets by DP rank, so its order changes with DP; this one never does.)

megatron-core writes the dataset's index cache (document, sample and shuffle
indices) under ``PREFIX/cache/GPTDataset_indices/``, as Megatron-LM does
without ``--data-cache-path``: rank 0 builds and writes it, every rank waits
at a barrier, the others then read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tenplex_megatron.flags import FlagError
from tenplex_megatron.plan.data_position import microbatch_sample_indices
from tenplex_megatron.training.dataset_files import DatasetError, check_dataset_tokenizer, check_indexed_dataset
from tenplex_megatron.training.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, Tokenizer

__all__ = ["BATCH_KEYS", "BYTE_VOCAB_SIZE", "ByteTokenizer", "build_train_dataset", "check_data_path",
           "check_indexed_dataset", "microbatches_from_dataset", "parse_blend"]

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as megatron-core's ``get_blend_from_list``: prefixes, or ``WEIGHT PREFIX`` pairs."""
    if not data_path:
        raise FlagError("--data-path needs at least one dataset prefix")
    if len(data_path) % 2 == 0:
        weights = []
        for w in data_path[0::2]:
            try:
                weights.append(float(w))
            except ValueError:
                weights.append(None)
        if all(w is not None for w in weights):
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise FlagError(f"--data-path {' '.join(data_path)}: blend weights must be >= 0 with a positive sum")
            return [p.strip() for p in data_path[1::2]], weights
        if any(w is not None for w in weights):
            raise FlagError(f"--data-path {' '.join(data_path)}: give either dataset prefixes or WEIGHT PREFIX pairs")
    return [p.strip() for p in data_path], None


def check_data_path(data_path: list[str], tokenizer: Tokenizer | None = None) -> None:
    """Raise DatasetError naming the first ``--data-path`` entry that is not a Megatron indexed dataset, or,
    given ``tokenizer``, that was built with another tokenizer (``dataset_files.check_dataset_tokenizer``).

    Free of torch.distributed: every rank runs it while parsing flags. Headers and sizes only, unless a
    dataset has no ``PREFIX.meta.json``: its ``.bin`` is then scanned for the largest token id.
    """
    prefixes = parse_blend(data_path)[0]
    for prefix in prefixes:
        check_indexed_dataset(prefix)
    if tokenizer is not None:
        for prefix in prefixes:
            check_dataset_tokenizer(prefix, tokenizer)


def build_train_dataset(
    data_path: list[str], split: str, seq_length: int, seed: int, num_samples: int, tokenizer: Any = None
) -> Any:
    """megatron-core's GPTDataset (train split, ``num_samples`` samples at least) over ``data_path``.

    Call on every rank (megatron-core builds on rank 0, barriers, then builds on
    the others from rank 0's cache); torch.distributed may also be uninitialized.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_data_path(data_path)
    prefixes, weights = parse_blend(data_path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        tokenizer=tokenizer if tokenizer is not None else ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if config.split_matrix[0] is None:
        raise DatasetError(f"--split {split} leaves no documents for training")
    config.split_matrix = [config.split_matrix[0], None, None]  # build the train split only
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        have = 0 if train is None else len(train)
        raise DatasetError(f"--data-path {' '.join(data_path)} with --split {split}: the train split gives {have} "
                           f"samples of {seq_length} tokens, the run needs {num_samples}")
    return train


def microbatches_from_dataset(
    dataset: Any, consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``.

    Same keys as ``synthetic_data.batch_from_indices``: tokens, labels (int64), loss_mask (float32) and
    position_ids, each ``[micro_batch_size, seq_length]``, stacked from ``dataset[i]`` for global indices ``i``.
    """
    for indices in microbatch_sample_indices(consumed_samples, global_batch_size, micro_batch_size, dp_size, dp_rank):
        items = [dataset[i] for i in indices]
        yield {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in BATCH_KEYS}
