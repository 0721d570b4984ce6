"""The DP-independent batch sampler installed into Megatron-LM's data loader with --tenplex."""

from __future__ import annotations

import pytest

from tenplex_megatron.frontdoor.megatron_lm import TenplexBatchSampler


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 2), (4, 1), (2, 4)])
def test_global_batches_do_not_depend_on_dp(dp: int, mbs: int) -> None:
    gbs, total, consumed = 8, 64, 16
    per_rank = [list(TenplexBatchSampler(total, consumed, gbs, mbs, dp, r)) for r in range(dp)]
    steps = (total - consumed) // gbs
    for r in range(dp):
        assert len(per_rank[r]) == steps * gbs // (mbs * dp)
    for step in range(steps):
        n = gbs // (mbs * dp)
        got = [i for r in range(dp) for mb in per_rank[r][step * n : (step + 1) * n] for i in mb]
        assert got == list(range(consumed + step * gbs, consumed + (step + 1) * gbs))


class _Samples:
    """A map-style dataset whose sample says its index and whether its worker ran the loader's worker_init_fn."""

    def __init__(self, n: int, split: object = None) -> None:
        self.n = n
        if split is not None:
            self.index_split = split

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, bool]:
        import os

        return i, os.environ.get("SAMPLER_TEST_WORKER_INIT") == "1"


def _init_worker(_: int) -> None:
    import os

    os.environ["SAMPLER_TEST_WORKER_INIT"] = "1"  # in the worker process only


def _collate(batch: list) -> tuple[str, list]:
    return "collated", batch


def test_the_tenplex_loader_keeps_every_setting_of_megatron_lms_but_the_sampler() -> None:
    """--exit-signal-handler's worker_init_fn, the workers (persistent), the collate: Megatron-LM's loader's, with
    tenplex's sampler; the batches come out of a real worker."""
    import torch

    from tenplex_megatron.frontdoor.megatron_lm import with_sampler

    stock = torch.utils.data.DataLoader(_Samples(32), batch_sampler=[[0, 1]], num_workers=1, pin_memory=False,
                                        persistent_workers=True, worker_init_fn=_init_worker, collate_fn=_collate)
    sampler = TenplexBatchSampler(32, 8, 8, 2, 2, 1)
    loader = with_sampler(stock, sampler)
    assert loader.batch_sampler is sampler and loader.dataset is stock.dataset
    assert (loader.worker_init_fn, loader.num_workers, loader.persistent_workers, loader.collate_fn) == \
        (_init_worker, 1, True, _collate)
    got = list(loader)
    assert got[0] == ("collated", [(12, True), (13, True)])  # step 1's second share, through the worker's init
    assert [[i for i, _ in b] for _, b in got] == list(sampler)


def test_only_the_training_split_takes_tenplex_sampler() -> None:
    from megatron.core.datasets.utils import Split

    from tenplex_megatron.frontdoor.megatron_lm import _training_split

    assert _training_split(_Samples(4, Split.train)) and _training_split(_Samples(4))  # none named: as before
    assert not _training_split(_Samples(4, Split.valid)) and not _training_split(_Samples(4, Split.test))
