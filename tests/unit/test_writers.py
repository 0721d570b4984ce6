"""assign_writers: every distinct chunk with a main replica written once, by one of its holders, bytes balanced."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from tenplex_megatron.plan.ptc import Chunk
from tenplex_megatron.plan.writers import Holding, assign_writers


def _row(i: int, key: str = "w", flat: tuple[int, int] | None = None) -> Chunk:
    return Chunk(key, (i, 0), (1, 8), flat)


def _written(assignment: dict[Chunk, int], nbytes: dict[Chunk, int]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for c, r in assignment.items():
        out[r] += nbytes[c]
    return dict(out)


def check_assignment(holdings: list[Holding]) -> dict[Chunk, int]:
    got = assign_writers(holdings)
    holders: dict[Chunk, set[int]] = defaultdict(set)
    main: dict[Chunk, bool] = defaultdict(bool)
    for h in holdings:
        holders[h.chunk].add(h.rank)
        main[h.chunk] |= h.main
    # exactly the chunks with a main replica, each by one of its own holders
    assert set(got) == {c for c in holders if main[c]}
    for c, r in got.items():
        assert r in holders[c], (c, r, holders[c])
    return got


@pytest.mark.parametrize("holders,chunks,per_rank", [(4, 8, 2), (2, 8, 4), (8, 8, 1), (3, 9, 3), (1, 5, 5)])
def test_equal_chunks_are_balanced_over_dp_replicas(holders: int, chunks: int, per_rank: int) -> None:
    holdings = [Holding(r, _row(i), r == 0, 32) for i in range(chunks) for r in range(holders)]
    got = check_assignment(holdings)
    counts: dict[int, int] = defaultdict(int)
    for r in got.values():
        counts[r] += 1
    assert dict(counts) == {r: per_rank for r in range(holders)}


def test_each_chunk_written_once_even_when_listed_twice() -> None:
    c = _row(0)
    got = check_assignment([Holding(0, c, True, 32), Holding(0, c, True, 32), Holding(1, c, False, 32)])
    assert len(got) == 1


def test_chunks_with_no_main_replica_are_not_written() -> None:
    tied_copy = Chunk("output_layer.weight", (0, 0), (16, 8))
    emb = Chunk("embedding.word_embeddings.weight", (0, 0), (16, 8))
    holdings = [
        Holding(0, emb, True, 512),
        Holding(1, emb, False, 512),  # a DP replica: may write, since rank 0's copy is main
        Holding(2, tied_copy, False, 512),  # never main anywhere: a copy of another tensor
        Holding(3, tied_copy, False, 512),
    ]
    got = check_assignment(holdings)
    assert tied_copy not in got
    assert got[emb] in (0, 1)


def test_bytes_are_balanced_with_unequal_chunk_sizes() -> None:
    # one big chunk and several small ones held by both ranks: the big one goes to one rank, smalls to the other
    big = Chunk("big", (0,), (64,))
    smalls = [Chunk("small", (i,), (1,)) for i in range(4)]
    sizes = {big: 256, **{c: 64 for c in smalls}}
    holdings = [Holding(r, c, r == 0, sizes[c]) for c in [*smalls, big] for r in (0, 1)]
    got = check_assignment(holdings)
    assert sorted(_written(got, sizes).values()) == [256, 256]


def test_random_holdings_are_balanced_and_valid() -> None:
    rng = random.Random(11)
    for _ in range(50):
        ranks = rng.randint(1, 6)
        holdings: list[Holding] = []
        nbytes: dict[Chunk, int] = {}
        for i in range(rng.randint(1, 30)):
            c = _row(i, key=rng.choice("ab"), flat=rng.choice([None, (0, 4), (4, 8)]))
            nbytes[c] = n = rng.choice([4, 4, 16])
            hs = rng.sample(range(ranks), rng.randint(1, ranks))
            has_main = rng.random() < 0.9
            holdings += [Holding(r, c, has_main and j == 0, n) for j, r in enumerate(hs)]
        got = check_assignment(holdings)
        # when every chunk is held by every rank (pure DP replication), the greedy spreads bytes within one chunk
        if all(len({h.rank for h in holdings if h.chunk == c}) == ranks for c in got):
            written = _written(got, nbytes)
            loads = [written.get(r, 0) for r in range(ranks)]
            assert max(loads) - min(loads) <= max(nbytes[c] for c in got), loads


def test_deterministic_and_independent_of_holding_order() -> None:
    holdings = [Holding(r, _row(i, flat=(0, 4) if i % 3 else None), r == 1, 16 + i % 2 * 16)
                for i in range(12) for r in range(4)]
    first = check_assignment(holdings)
    assert assign_writers(holdings) == first
    shuffled = list(holdings)
    random.Random(5).shuffle(shuffled)
    assert assign_writers(shuffled) == first


def test_empty() -> None:
    assert assign_writers([]) == {}
