"""Host-shared checksum checks: each block needed on a host is checked by exactly one of its ranks that needs it."""

from __future__ import annotations

import random

import pytest

from tenplex_megatron.plan.verify_share import blocks, merge, share_blocks, to_intervals


def _blocks(intervals):
    return {(s, b) for s, lo, hi in intervals for b in range(lo, hi + 1)}


def test_to_intervals_merges_consecutive_blocks_per_source() -> None:
    assert to_intervals([(0, 3), (0, 1), (0, 2), (1, 4), (0, 7)]) == [(0, 1, 3), (0, 7, 7), (1, 4, 4)]
    assert merge([(0, 5, 9), (0, 0, 4), (0, 2, 3), (2, 0, 0)]) == [(0, 0, 9), (2, 0, 0)]


def test_two_tp_ranks_split_the_blocks_they_both_need() -> None:
    needs = {0: [(0, 0, 9)], 1: [(0, 0, 9)]}
    hosts = {0: "a", 1: "a"}
    mine = {r: share_blocks(needs, hosts, r) for r in needs}
    assert _blocks(mine[0]) | _blocks(mine[1]) == _blocks(needs[0])
    assert not _blocks(mine[0]) & _blocks(mine[1])
    assert len(_blocks(mine[0])) == len(_blocks(mine[1])) == 5


def test_other_hosts_do_not_share() -> None:
    needs = {0: [(0, 0, 9)], 1: [(0, 0, 9)]}
    hosts = {0: "a", 1: "b"}
    assert share_blocks(needs, hosts, 0) == [(0, 0, 9)] and share_blocks(needs, hosts, 1) == [(0, 0, 9)]


def test_a_rank_only_checks_blocks_it_needs() -> None:
    needs = {0: [(0, 0, 3)], 1: [(0, 2, 9)]}
    hosts = {0: "a", 1: "a"}
    assert _blocks(share_blocks(needs, hosts, 0)) <= _blocks(needs[0])
    assert _blocks(share_blocks(needs, hosts, 1)) >= {(0, b) for b in range(4, 10)}


@pytest.mark.parametrize("seed", range(40))
def test_random_needs_are_covered_exactly_once_per_host(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    hosts = {r: f"h{r // rng.choice([1, 2, 4, 8])}" for r in range(world)}
    needs = {}
    for r in range(world):
        needs[r] = []
        for _ in range(rng.randint(0, 4)):
            s, lo = rng.randrange(3), rng.randrange(20)
            needs[r].append((s, lo, lo + rng.randrange(12)))
    mine = {r: share_blocks(needs, hosts, r) for r in range(world)}
    for h in set(hosts.values()):
        ranks = [r for r in range(world) if hosts[r] == h]
        wanted = set().union(*(_blocks(needs[r]) for r in ranks))
        got = [_blocks(mine[r]) for r in ranks]
        assert set().union(*got) == wanted
        assert sum(len(g) for g in got) == len(wanted)  # no block twice on a host
        for r, g in zip(ranks, got):
            assert g <= _blocks(needs[r])  # only blocks the rank reads itself (it has them open)


def test_blocks_lists_what_to_intervals_merged() -> None:
    pairs = [(0, 3), (0, 4), (0, 5), (2, 0), (0, 9)]
    assert sorted(blocks(to_intervals(pairs))) == sorted(pairs)
