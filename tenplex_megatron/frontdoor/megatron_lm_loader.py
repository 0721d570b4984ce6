"""The training split's loader under ``--tenplex``: tenplex's DP-independent batch sampler in the DataLoader
Megatron-LM's own builder made (its settings kept, its sampler replaced)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tenplex_megatron.plan.batch_schedule import BatchSchedule, constant
from tenplex_megatron.plan.data_position import batch_sample_indices


class TenplexBatchSampler:
    """Micro-batches of global indices: the global batch at consumed position c is samples [c, c + g(c)) (g: Megatron-LM's
    batch schedule, or one ``global_batch_size``), DP rank r reads share r."""

    def __init__(self, total_samples: int, consumed_samples: int, schedule: BatchSchedule | int,
                 micro_batch_size: int, dp_size: int, dp_rank: int):
        self.schedule = constant(schedule) if isinstance(schedule, int) else schedule
        self.total, self.mbs, self.dp, self.rank = total_samples, micro_batch_size, dp_size, dp_rank
        fixed = self.schedule.ramp is None and not self.schedule.steps  # a fixed batch: whole batches from 0
        self.consumed = consumed_samples - consumed_samples % self.schedule.final if fixed else consumed_samples

    def __iter__(self) -> Iterator[list[int]]:
        for start, size in self.schedule.batches(self.consumed, self.total):
            yield from batch_sample_indices(start, size, self.mbs, self.dp, self.rank)

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp)


def _training_split(dataset: Any) -> bool:
    """Whether ``dataset`` is the training split, as Megatron-LM's builder tells (``split``, else ``index_split``);
    a dataset naming none is taken for one."""
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    return split is None or getattr(split, "name", split) == "train"


#: the settings of a DataLoader that :func:`with_sampler` keeps (those a torch release lacks are left out)
_LOADER_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def with_sampler(stock: Any, batch_sampler: Any) -> Any:
    """A DataLoader over ``stock``'s dataset with every setting of ``stock`` (a ``torch.utils.data.DataLoader``) but
    its batch sampler, which is ``batch_sampler``."""
    import torch

    kw = {k: getattr(stock, k) for k in _LOADER_SETTINGS if hasattr(stock, k)}
    return torch.utils.data.DataLoader(stock.dataset, batch_sampler=batch_sampler, **kw)
