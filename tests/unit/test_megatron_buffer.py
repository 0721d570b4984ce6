"""megatron-core 0.16.1's grad-buffer layout (plan/megatron_buffer.py): reverse order, 64-element starts, the shared
embedding's own bucket, bucket ends padded to lcm(DP, 128), and dp_reshardable's saved pieces (gaps included)."""

from __future__ import annotations

from tenplex_megatron.plan.megatron_buffer import BufferParam, Piece, bucket_layout


def test_reverse_order_aligned_starts_and_dp_pieces() -> None:
    (b,) = bucket_layout([BufferParam("a", 100), BufferParam("b", 10)], dp=2)
    # reversed: b at 0..10, a at 64..164; unpadded 164, padded to lcm(2, 128) = 256, 128 per DP rank
    assert b.params == (("b", 0, 10), ("a", 64, 164))
    assert (b.numel, b.numel_unpadded) == (256, 164)
    assert b.pieces == (
        Piece(0, 10, 0, "b", 0), Piece(10, 64, 0), Piece(64, 128, 0, "a", 64),  # the gap is saved
        Piece(128, 164, 1, "a", 64),  # rank 1: the rest of a; its end padding is not saved
    )
    covered = sorted((p.start, p.stop) for p in b.pieces)
    assert covered[0][0] == 0 and covered[-1][1] == b.numel_unpadded
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))  # every element, once


def test_shared_embedding_gets_its_own_bucket() -> None:
    params = [BufferParam("emb", 300, shared_embedding=True), BufferParam("w", 50)]
    first, second = bucket_layout(params, dp=3)
    assert first.params == (("w", 0, 50),) and first.numel == 384  # lcm(3, 128)
    assert second.params == (("emb", 0, 300),) and (second.numel, second.numel_unpadded) == (384, 300)
    assert [(p.start, p.stop, p.dp_rank) for p in second.pieces] == [(0, 128, 0), (128, 256, 1), (256, 300, 2)]


def test_bucket_size_splits() -> None:
    buckets = bucket_layout([BufferParam(f"p{i}", 64) for i in range(4)], dp=1, bucket_size=128)
    assert [b.params for b in buckets] == [(("p3", 0, 64), ("p2", 64, 128)), (("p1", 0, 64), ("p0", 64, 128))]
