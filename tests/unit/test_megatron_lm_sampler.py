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
