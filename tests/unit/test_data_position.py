"""Data position: a global batch holds the same samples, in the same order, whatever the DP size."""

from __future__ import annotations

import re

import pytest

from tenplex_megatron.plan.data_position import microbatch_sample_indices, num_microbatches


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("gbs", [1, 6, 8, 12, 16])
def test_global_batch_is_independent_of_dp(gbs: int) -> None:
    for step in range(4):
        consumed = step * gbs
        expected = list(range(step * gbs, (step + 1) * gbs))
        for dp in _divisors(gbs):
            for mbs in _divisors(gbs // dp):
                n = num_microbatches(gbs, mbs, dp)
                per_rank = [microbatch_sample_indices(consumed, gbs, mbs, dp, r) for r in range(dp)]
                for mbs_list in per_rank:
                    assert len(mbs_list) == n
                    assert all(len(mb) == mbs for mb in mbs_list)
                got = [i for rank in per_rank for mb in rank for i in mb]
                assert got == expected, (gbs, dp, mbs, step)


@pytest.mark.parametrize(
    "gbs,mbs,dp,expected",
    [(8, 1, 1, 8), (8, 2, 1, 4), (8, 2, 2, 2), (8, 1, 4, 2), (8, 8, 1, 1), (12, 2, 3, 2), (12, 1, 12, 1)],
)
def test_num_microbatches(gbs: int, mbs: int, dp: int, expected: int) -> None:
    assert num_microbatches(gbs, mbs, dp) == expected


def test_microbatch_table() -> None:
    # global batch 2 (samples 16..23) at DP=2, micro-batch 2: rank 1 reads the second half
    assert microbatch_sample_indices(16, 8, 2, 2, 1) == [[20, 21], [22, 23]]
    assert microbatch_sample_indices(16, 8, 2, 2, 0) == [[16, 17], [18, 19]]
    assert microbatch_sample_indices(0, 8, 4, 1, 0) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "gbs,mbs,dp,valid",
    [(8, 3, 1, [1, 2, 4, 8]), (8, 4, 4, [1, 2]), (12, 5, 2, [1, 2, 3, 6]), (16, 3, 4, [1, 2, 4])],
)
def test_num_microbatches_error_names_valid_micro_batch_sizes(gbs: int, mbs: int, dp: int, valid: list[int]) -> None:
    with pytest.raises(ValueError) as e:
        num_microbatches(gbs, mbs, dp)
    msg = str(e.value)
    assert f"valid micro-batch sizes are {valid}" in msg
    assert str(gbs) in msg and f"{mbs} x {dp}" in msg
    for m in valid:  # and every size it names does work
        assert num_microbatches(gbs, m, dp) * m * dp == gbs


def test_dp_that_does_not_divide_the_global_batch() -> None:
    with pytest.raises(ValueError) as e:
        num_microbatches(10, 1, 3)
    assert re.search(r"valid micro-batch sizes are \[\].*none", str(e.value))


@pytest.mark.parametrize("mbs,dp", [(0, 1), (1, 0), (-1, 2)])
def test_non_positive_sizes(mbs: int, dp: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        num_microbatches(8, mbs, dp)


def test_consumed_samples_must_be_a_whole_number_of_global_batches() -> None:
    with pytest.raises(ValueError, match="consumed samples 12 .*global batch size 8"):
        microbatch_sample_indices(12, 8, 1, 1, 0)


@pytest.mark.parametrize("dp_rank,dp", [(2, 2), (5, 4), (-1, 2)])
def test_dp_rank_must_be_below_dp_size(dp_rank: int, dp: int) -> None:
    with pytest.raises(ValueError, match=rf"DP rank {dp_rank} is out of range for DP size {dp}"):
        microbatch_sample_indices(0, 8, 1, dp, dp_rank)
