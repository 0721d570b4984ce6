"""Megatron's indexed datasets through megatron.core.datasets, read in a DP-independent order.

Tokenizer: byte-level, vocabulary **257** = the 256 byte values of UTF-8 text
(ids 0-255) plus one end-of-document token (id 256). It needs no download and
no training. It has no pad token: megatron-core then pads a short final sample
with -1, an id no real token has, masks it out of the loss and feeds it to the
model as id 0 (``MegatronDataset._pad_token_id``), so 257 embedding rows are
all the model needs.

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

import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tenplex_megatron.plan.data_position import microbatch_sample_indices

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
_DTYPE_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # indexed_dataset.DType code -> bytes
BYTE_VOCAB_SIZE = 257
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class ByteTokenizer:
    """Byte-level tokenizer for megatron-core's GPTDataset: vocabulary 257 (bytes 0-255 + end-of-document 256).

    A plain class with the attributes megatron-core's datasets read (``vocab_size``,
    ``eod``, ``unique_identifiers``), as megatron-core's own ``NullTokenizer`` is:
    the legacy ``MegatronLegacyTokenizer`` base is deprecated in 0.16 and the new
    ``MegatronTokenizerBase`` wants a tokenizer file. No pad token (see the module
    docstring).
    """

    EOD = 256

    def tokenize(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as int64 ids (no end-of-document appended)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def detokenize(self, ids: Any) -> str:
        """Text of ``ids``; end-of-document tokens are dropped, bad UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    text_to_ids = tokenize
    ids_to_text = detokenize

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Property required by megatron-core's datasets (it keys their index cache)."""
        return OrderedDict({"class": f"{type(self).__module__}.{type(self).__qualname__}",
                            "vocab_size": BYTE_VOCAB_SIZE})

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)} | {"<eod>": self.EOD}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self.EOD


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as megatron-core's ``get_blend_from_list``: prefixes, or ``WEIGHT PREFIX`` pairs."""
    if not data_path:
        raise ValueError("--data-path needs at least one dataset prefix")
    if len(data_path) % 2 == 0:
        weights = []
        for w in data_path[0::2]:
            try:
                weights.append(float(w))
            except ValueError:
                weights.append(None)
        if all(w is not None for w in weights):
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"--data-path {' '.join(data_path)}: blend weights must be >= 0 with a positive sum")
            return [p.strip() for p in data_path[1::2]], weights
        if any(w is not None for w in weights):
            raise ValueError(f"--data-path {' '.join(data_path)}: give either dataset prefixes or WEIGHT PREFIX pairs")
    return [p.strip() for p in data_path], None


def check_indexed_dataset(prefix: str) -> None:
    """Raise ValueError naming ``prefix`` unless it is a readable Megatron indexed dataset (.bin + .idx)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"--data-path {prefix}: not a Megatron indexed dataset ({', '.join(missing)} missing)")
    idx_size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise ValueError(f"--data-path {prefix}: {idx} is not a Megatron index file (bad header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in _DTYPE_SIZE:
            raise ValueError(f"--data-path {prefix}: {idx} is not a Megatron index file "
                             f"(version {version}, dtype code {code})")
        if idx_size < 34 + 12 * n_seq + 8 * n_doc:
            raise ValueError(f"--data-path {prefix}: {idx} is truncated ({idx_size} bytes for {n_seq} sequences)")
        if n_seq == 0:
            raise ValueError(f"--data-path {prefix}: the dataset holds no documents")
        f.seek(34 + 4 * (n_seq - 1))
        (last_len,) = struct.unpack("<i", f.read(4))
        f.seek(34 + 4 * n_seq + 8 * (n_seq - 1))
        (last_ptr,) = struct.unpack("<q", f.read(8))
    expected, got = last_ptr + last_len * _DTYPE_SIZE[code], os.path.getsize(bin_)
    if expected != got:
        raise ValueError(f"--data-path {prefix}: {bin_} has {got} bytes, its index {idx} describes {expected}")


def check_data_path(data_path: list[str]) -> None:
    """Raise ValueError naming the first ``--data-path`` entry that is not a Megatron indexed dataset.

    Cheap (headers and sizes only) and free of torch.distributed: every rank runs it while parsing flags.
    """
    for prefix in parse_blend(data_path)[0]:
        check_indexed_dataset(prefix)


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
        raise ValueError(f"--split {split} leaves no documents for training")
    config.split_matrix = [config.split_matrix[0], None, None]  # build the train split only
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        have = 0 if train is None else len(train)
        raise ValueError(f"--data-path {' '.join(data_path)} with --split {split}: the train split gives {have} "
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
