"""The re-sharding planner on hand-built GPT-like checkpoints, checked by executing its plans with numpy.

Source and destination chunks come from a small layout model written here (not
``shard_layout``): TP splits a tensor's ``tp_axis`` evenly, PP splits the layer
axis, and megatron's distributed optimizer lays each model-parallel rank's boxes
end to end in one buffer padded to a multiple of DP, each DP rank owning a
contiguous flat range of it. Every source element holds a value derived from its
global index (vocabulary padding rows hold negative values), every plan is
executed, and every destination element must equal its global value, or zero
for vocabulary padding rows whose padded size changed, written exactly once.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import PlanError, Planner, ReshardPlan, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta, dtype_size

VOCAB = 10

# ---------------------------------------------------------------------------------------------------------------
# A tiny GPT-like model and a hand-written layout model
# ---------------------------------------------------------------------------------------------------------------


def model(padded_vocab: int) -> dict[str, TensorMeta]:
    ts = [
        TensorMeta("embedding.word_embeddings.weight", (padded_vocab, 6), "float32", vocab_rows=VOCAB, tp_axis=0,
                   stage="first"),
        TensorMeta("decoder.layers.qkv.weight", (2, 8, 6), "float32", tp_axis=1, stage="layers"),
        TensorMeta("decoder.layers.proj.weight", (2, 6, 8), "float32", tp_axis=2, stage="layers"),
        TensorMeta("decoder.layers.qkv.bias", (2, 8), "bfloat16", tp_axis=1, stage="layers"),
        TensorMeta("decoder.layers.norm.weight", (2, 6), "float32", stage="layers"),  # replicated over TP
        TensorMeta("decoder.final_layernorm.weight", (6,), "float32", stage="last"),
        TensorMeta("optimizer.step", (), "int64", stage="first"),  # a 0-d tensor, never DP-sharded
    ]
    return {t.key: t for t in ts}


@dataclass(frozen=True)
class Spec:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    distopt: bool = False  # megatron-core's distributed optimizer: DP ranks hold flat ranges

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.dp)


def _boxes(t: TensorMeta, spec: Spec, tp_rank: int, pp_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    off, shp = [0] * len(t.global_shape), list(t.global_shape)
    if t.stage == "layers":
        per = shp[0] // spec.pp
        off[0], shp[0] = pp_rank * per, per
    elif t.stage == "first" and pp_rank != 0 or t.stage == "last" and pp_rank != spec.pp - 1:
        return []
    if t.tp_axis is not None:
        per = shp[t.tp_axis] // spec.tp
        assert per * spec.tp == shp[t.tp_axis]
        off[t.tp_axis], shp[t.tp_axis] = tp_rank * per, per
    return [(tuple(off), tuple(shp))]


def rank_chunks(tensors: dict[str, TensorMeta], spec: Spec) -> dict[int, list[Chunk]]:
    out: dict[int, list[Chunk]] = {}
    for rank in range(spec.layout.world_size):
        tp_rank, pp_rank, dp_rank = spec.layout.rank_coords(rank)
        chunks: list[Chunk] = []
        buffer: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for key, t in sorted(tensors.items()):
            for off, shp in _boxes(t, spec, tp_rank, pp_rank):
                if spec.distopt and t.dtype != "int64":
                    buffer.append((key, off, shp))
                else:
                    chunks.append(Chunk(key, off, shp))
        total = sum(math.prod(s) for _, _, s in buffer)
        padded = -(-total // spec.dp) * spec.dp
        lo, hi = dp_rank * padded // spec.dp, (dp_rank + 1) * padded // spec.dp
        pos = 0
        for key, off, shp in buffer:
            n = math.prod(shp)
            a, b = max(lo, pos) - pos, min(hi, pos + n) - pos
            if a < b:
                chunks.append(Chunk(key, off, shp, (a, b)))
            pos += n
        out[rank] = chunks
    return out


def global_value(meta: TensorMeta) -> np.ndarray:
    """Distinct non-zero values; vocabulary padding rows are negative (never valid content)."""
    base = (zlib.crc32(meta.key.encode()) % 997 + 1) * 10_000
    full = (np.arange(meta.numel, dtype=np.float64) + base).reshape(meta.global_shape)
    if meta.vocab_rows is not None:
        full[meta.vocab_rows :] *= -1
    return full


def chunk_data(full: np.ndarray, c: Chunk) -> np.ndarray:
    box = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))].reshape(-1)
    a, b = c.flat_range
    return box[a:b].copy()


def host_of(rank: int) -> str:
    return f"host{rank // 2}"


def build_source(tensors: dict[str, TensorMeta], spec: Spec, replicas: bool) -> tuple[PTC, dict[Location, np.ndarray]]:
    """The source PTC (every holder's copy when ``replicas``, else one per chunk) and each location's data."""
    stored: list[StoredChunk] = []
    seen: set[Chunk] = set()
    data: dict[Location, np.ndarray] = {}
    for rank, chunks in rank_chunks(tensors, spec).items():
        for c in chunks:
            if c in seen and not replicas:
                continue
            seen.add(c)
            loc = Location(f"rank_{rank:05d}.safetensors", f"{c.key}@{c.offsets}#{c.flat}", rank, host_of(rank))
            stored.append(StoredChunk(c, loc))
            data[loc] = chunk_data(global_value(tensors[c.key]), c)
    return PTC(tensors, tuple(stored), spec.layout.to_json()), data


# ---------------------------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------------------------


def execute(plan: ReshardPlan, rank: int, data: dict[Location, np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Run one rank's plan on flat numpy chunks; asserts bounds and that nothing is written twice."""
    rp = plan.ranks[rank]
    out = [np.full(c.numel, np.nan) for c in rp.chunks]
    for p in rp.pieces:
        src = data[plan.sources[p.source].location]
        n_src, n_dst = math.prod(p.src_rect), math.prod(p.dst_rect)
        assert 0 <= p.src_start and p.src_start + n_src <= src.size, p
        assert 0 <= p.dst_start and p.dst_start + n_dst <= out[p.dst].size, p
        assert all(0 <= o and o + s <= r for o, s, r in zip(p.src_sel, p.shape, p.src_rect)), p
        assert all(0 <= o and o + s <= r for o, s, r in zip(p.dst_sel, p.shape, p.dst_rect)), p
        assert p.numel == math.prod(p.shape) > 0
        s = src[p.src_start : p.src_start + n_src].reshape(p.src_rect)
        d = out[p.dst][p.dst_start : p.dst_start + n_dst].reshape(p.dst_rect)
        view = d[(..., *(slice(o, o + n) for o, n in zip(p.dst_sel, p.shape)))]  # a view, also for 0-d
        assert np.isnan(view).all(), "an element is written twice"
        view[...] = s[tuple(slice(o, o + n) for o, n in zip(p.src_sel, p.shape))]
    filled = 0
    for f in rp.fills:
        n_dst = math.prod(f.dst_rect)
        assert 0 <= f.dst_start and f.dst_start + n_dst <= out[f.dst].size, f
        d = out[f.dst][f.dst_start : f.dst_start + n_dst].reshape(f.dst_rect)
        view = d[(..., *(slice(o, o + n) for o, n in zip(f.dst_sel, f.shape)))]
        assert np.isnan(view).all(), "an element is written twice"
        view[...] = 0
        filled += f.numel
    return out, filled


def expected_global(src: TensorMeta, dst: TensorMeta) -> tuple[np.ndarray, np.ndarray]:
    """The destination tensor's expected values and a mask of its zero-filled (new padding) elements."""
    full = global_value(src)
    if src.global_shape == dst.global_shape:
        return full, np.zeros(dst.global_shape, dtype=bool)
    expect = np.zeros(dst.global_shape)
    expect[: src.vocab_rows] = full[: src.vocab_rows]
    mask = np.zeros(dst.global_shape, dtype=bool)
    mask[src.vocab_rows :] = True
    return expect, mask


CASES = {
    # name: (source spec, source padded vocab, destination spec, destination padded vocab, source replicas)
    "identity tp2": (Spec(tp=2), 16, Spec(tp=2), 16, False),
    "tp2->tp1 keep padding": (Spec(tp=2), 16, Spec(tp=1), 16, False),
    "tp2->tp1 repad 16->12": (Spec(tp=2), 16, Spec(tp=1), 12, False),
    "tp1->tp2 repad 12->16": (Spec(tp=1), 12, Spec(tp=2), 16, False),
    "tp1->tp4": (Spec(tp=1), 12, Spec(tp=4), 16, False),
    "tp4->tp2": (Spec(tp=4), 16, Spec(tp=2), 16, False),
    "dp2 flat->dp1": (Spec(dp=2, distopt=True), 12, Spec(dp=1), 12, False),
    "dp2 flat->dp1 flat": (Spec(dp=2, distopt=True), 12, Spec(dp=1, distopt=True), 12, False),
    "dp1->dp2 flat": (Spec(dp=1), 12, Spec(dp=2, distopt=True), 12, False),
    "dp2 flat->dp3 flat": (Spec(dp=2, distopt=True), 12, Spec(dp=3, distopt=True), 12, False),
    "dp4 flat->dp3 flat repad": (Spec(dp=4, distopt=True), 16, Spec(dp=3, distopt=True), 12, False),
    "tp2 dp2 flat->tp1 dp3 flat": (Spec(tp=2, dp=2, distopt=True), 16, Spec(tp=1, dp=3, distopt=True), 12, False),
    "tp1 dp4 flat->tp2 dp2 flat": (Spec(tp=1, dp=4, distopt=True), 12, Spec(tp=2, dp=2, distopt=True), 16, False),
    "tp2 dp2 replicas->tp1": (Spec(tp=2, dp=2), 16, Spec(tp=1), 16, True),
    "tp2 dp2 replicas->tp1 dp2 flat": (Spec(tp=2, dp=2), 16, Spec(tp=1, dp=2, distopt=True), 16, True),
    "pp2 tp2->tp1 pp1 dp2 flat": (Spec(tp=2, pp=2), 16, Spec(dp=2, distopt=True), 12, False),
    "tp1 pp1 dp2 flat->tp2 pp2": (Spec(dp=2, distopt=True), 12, Spec(tp=2, pp=2), 16, False),
    "tp2 pp2 dp2 flat->tp4 pp1 dp2 flat": (Spec(2, 2, 2, True), 16, Spec(4, 1, 2, True), 16, True),
}


def _plan_case(name: str):
    src_spec, src_pad, dst_spec, dst_pad, replicas = CASES[name]
    src_t, dst_t = model(src_pad), model(dst_pad)
    source, data = build_source(src_t, src_spec, replicas)
    dst_chunks = rank_chunks(dst_t, dst_spec)
    hosts = {r: host_of(r) for r in dst_chunks}
    return src_t, dst_t, source, data, dst_chunks, hosts


@pytest.mark.parametrize("name", list(CASES))
def test_executed_plan_rebuilds_every_destination_element(name: str) -> None:
    src_t, dst_t, source, data, dst_chunks, hosts = _plan_case(name)
    plan = plan_reshard(source, dst_t, dst_chunks, hosts=hosts)
    assert sorted(plan.ranks) == sorted(dst_chunks)
    assert plan.sources == source.chunks
    assert plan.unused_tensors == ()
    total_filled = 0
    for rank, rp in plan.ranks.items():
        assert list(rp.chunks) == dst_chunks[rank]
        out, filled = execute(plan, rank, data)
        expect_bytes = 0
        expect_filled = 0
        for c, got in zip(rp.chunks, out):
            expect, mask = expected_global(src_t[c.key], dst_t[c.key])
            np.testing.assert_array_equal(got, chunk_data(expect, c), err_msg=f"{name}: rank {rank} {c}")
            n_fill = int(chunk_data(mask, c).sum())
            expect_filled += n_fill
            expect_bytes += (c.numel - n_fill) * dtype_size(dst_t[c.key].dtype)
        assert filled == expect_filled
        # each destination element is read exactly once: the bytes read are the minimum
        assert rp.bytes_read == expect_bytes
        assert sum(rp.bytes_by_file.values()) == rp.bytes_read
        by_file: dict[str, int] = {}
        for p in rp.pieces:
            sc = plan.sources[p.source]
            by_file[sc.location.file] = by_file.get(sc.location.file, 0) + p.numel * dtype_size(
                src_t[sc.chunk.key].dtype)
        assert by_file == {f: n for f, n in rp.bytes_by_file.items() if n}
        # the bytes-only dry-run path agrees
        assert Planner(source, dst_t).rank_bytes(rank, list(rp.chunks))[0] == rp.bytes_read
        total_filled += filled
    assert plan.total_bytes_read == sum(plan.bytes_per_rank().values())
    if src_t != dst_t:  # the padded vocabulary changed: its padding rows are zero-filled, never copied
        assert total_filled > 0


@pytest.mark.parametrize("name", ["tp2->tp1 repad 16->12", "tp1->tp2 repad 12->16", "dp4 flat->dp3 flat repad"])
def test_vocab_padding_rows_are_zero_after_a_padded_size_change(name: str) -> None:
    src_t, dst_t, source, data, dst_chunks, hosts = _plan_case(name)
    key = "embedding.word_embeddings.weight"
    assert src_t[key].global_shape != dst_t[key].global_shape
    plan = plan_reshard(source, dst_t, dst_chunks, hosts=hosts)
    full = np.full(dst_t[key].global_shape, np.nan)
    for rank, rp in plan.ranks.items():
        out, _ = execute(plan, rank, data)
        for c, got in zip(rp.chunks, out):
            if c.key == key:
                region = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))].reshape(-1)
                a, b = c.flat_range
                region[a:b] = got
                full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))] = region.reshape(c.shape)
    assert not np.isnan(full).any()
    assert (full[VOCAB:] == 0).all()  # no negative source padding value leaked in
    np.testing.assert_array_equal(full[:VOCAB], global_value(src_t[key])[:VOCAB])


@pytest.mark.parametrize("name", ["tp2 dp2 flat->tp1 dp3 flat", "tp2 dp2 replicas->tp1 dp2 flat", "tp1->tp4"])
def test_plan_is_deterministic_and_rank_local(name: str) -> None:
    _, dst_t, source, _, dst_chunks, hosts = _plan_case(name)
    plan = plan_reshard(source, dst_t, dst_chunks, hosts=hosts)
    assert plan_reshard(source, dst_t, dst_chunks, hosts=hosts) == plan
    for rank in dst_chunks:  # a rank planning only for itself gets exactly its part of the whole plan
        alone = plan_reshard(source, dst_t, dst_chunks, hosts=hosts, ranks=[rank])
        assert list(alone.ranks) == [rank]
        assert alone.ranks[rank] == plan.ranks[rank]


def test_plan_does_not_depend_on_the_order_of_source_chunks() -> None:
    _, dst_t, source, _, dst_chunks, hosts = _plan_case("tp2 dp2 replicas->tp1 dp2 flat")
    shuffled = list(source.chunks)
    random.Random(3).shuffle(shuffled)
    other = PTC(source.tensors, tuple(shuffled), source.layout)

    def resolved(p: ReshardPlan):
        return {
            r: [(p.sources[x.source], x.src_start, x.src_rect, x.src_sel, x.dst, x.dst_start, x.dst_sel, x.shape)
                for x in rp.pieces]
            for r, rp in p.ranks.items()
        }

    assert resolved(plan_reshard(other, dst_t, dst_chunks, hosts=hosts)) == resolved(
        plan_reshard(source, dst_t, dst_chunks, hosts=hosts))


# ---------------------------------------------------------------------------------------------------------------
# Replica choice
# ---------------------------------------------------------------------------------------------------------------

W = {"w": TensorMeta("w", (8, 4), "float32")}


def _replicated_source(hosts: list[str]) -> PTC:
    """Every row of ``w`` stored on every one of ``len(hosts)`` ranks."""
    return PTC(W, tuple(
        StoredChunk(Chunk("w", (row, 0), (1, 4)), Location(f"rank_{r}", f"w{row}", r, h))
        for row in range(8) for r, h in enumerate(hosts)
    ))


def _reads_by_rank(plan: ReshardPlan) -> dict[int, int]:
    out: dict[int, int] = {}
    for rp in plan.ranks.values():
        for p in rp.pieces:
            loc = plan.sources[p.source].location
            out[loc.rank] = out.get(loc.rank, 0) + p.numel * 4
    return out


def test_identical_replicas_spread_reads_across_destinations() -> None:
    source = PTC(W, (
        StoredChunk(Chunk("w", (0, 0), (8, 4)), Location("a.st", "w", 0, "hostA")),
        StoredChunk(Chunk("w", (0, 0), (8, 4)), Location("b.st", "w", 1, "hostB")),
    ))
    dst = {r: [Chunk("w", (0, 0), (8, 4))] for r in range(4)}
    plan = plan_reshard(source, W, dst)
    assert _reads_by_rank(plan) == {0: 2 * 128, 1: 2 * 128}  # two destinations read each replica
    assert {f: n for rp in plan.ranks.values() for f, n in rp.bytes_by_file.items()}.keys() == {"a.st", "b.st"}
    assert all(rp.bytes_read == 128 for rp in plan.ranks.values())  # a replica is read once, not once per copy


def test_stored_bytes_count_replicas_and_distinct_bytes_do_not() -> None:
    """``w`` (8 x 4 fp32, 128 bytes) on three ranks: the checkpoint holds 384 bytes, 128 of them distinct; a tensor
    the checkpoint does not store counts in neither."""
    source = PTC({**W, "absent": TensorMeta("absent", (2,), "float32")}, _replicated_source(["a", "b", "c"]).chunks)
    assert (source.total_bytes(), source.distinct_bytes()) == (3 * 128, 128)


def test_identical_replicas_spread_reads_across_chunks_of_one_destination() -> None:
    source = _replicated_source(["hostA", "hostB"])
    plan = plan_reshard(source, W, {0: [Chunk("w", (0, 0), (8, 4))]})
    assert _reads_by_rank(plan) == {0: 4 * 16, 1: 4 * 16}
    assert plan.ranks[0].bytes_read == 8 * 16


def test_destination_prefers_a_replica_on_its_own_host() -> None:
    source = _replicated_source(["hostA", "hostB", "hostB", "hostC"])
    dst = {r: [Chunk("w", (0, 0), (8, 4))] for r in range(4)}
    hosts = {0: "hostA", 1: "hostB", 2: "hostB", 3: "hostD"}
    plan = plan_reshard(source, W, dst, hosts=hosts)
    for rank, rp in plan.ranks.items():
        src_hosts = {plan.sources[p.source].location.host for p in rp.pieces}
        if hosts[rank] == "hostD":  # nothing local: reads are spread over every replica
            assert len({plan.sources[p.source].location.rank for p in rp.pieces}) == 4
        else:
            assert src_hosts == {hosts[rank]}, (rank, src_hosts)
    # the two destinations on hostB share its two replicas evenly
    reads_b: dict[int, int] = {}
    for r in (1, 2):
        for p in plan.ranks[r].pieces:
            loc = plan.sources[p.source].location
            reads_b[loc.rank] = reads_b.get(loc.rank, 0) + p.numel
    assert reads_b == {1: 32, 2: 32}


def test_rank_bytes_counts_cross_node_reads() -> None:
    source = _replicated_source(["h0", "h1"])  # rank 0 on node 0, rank 1 on node 1 (1 GPU per node)
    planner = Planner(source, W)
    chunks = [Chunk("w", (0, 0), (8, 4))]
    total, cross = planner.rank_bytes(0, chunks, host="h0", gpus_per_node=1)
    assert (total, cross) == (128, 0)  # everything on its own host
    total, cross = planner.rank_bytes(5, chunks, host="elsewhere", gpus_per_node=1)
    assert (total, cross) == (128, 128)  # node 5 holds none of the replicas


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

A = {"a": TensorMeta("a", (4, 6), "float32")}


def _ptc(tensors: dict[str, TensorMeta], chunks: list[Chunk]) -> PTC:
    return PTC(tensors, tuple(StoredChunk(c, Location(f"f{i}", f"n{i}", i)) for i, c in enumerate(chunks)))


WHOLE = [Chunk("a", (0, 0), (4, 6))]


def test_shape_mismatch_names_the_tensor_and_both_shapes() -> None:
    dst = {"a": TensorMeta("a", (4, 8), "float32")}
    with pytest.raises(PlanError) as e:
        plan_reshard(_ptc(A, WHOLE), dst, {0: [Chunk("a", (0, 0), (4, 8))]})
    msg = str(e.value)
    assert "'a'" in msg and "(4, 6)" in msg and "(4, 8)" in msg


def test_vocab_rows_mismatch_is_a_shape_mismatch() -> None:
    src = {"e": TensorMeta("e", (16, 2), "float32", vocab_rows=10)}
    dst = {"e": TensorMeta("e", (12, 2), "float32", vocab_rows=11)}
    with pytest.raises(PlanError, match=r"'e'.*\(16, 2\).*\(12, 2\)"):
        plan_reshard(_ptc(src, [Chunk("e", (0, 0), (16, 2))]), dst, {0: [Chunk("e", (0, 0), (12, 2))]})


@pytest.mark.parametrize(
    "chunks",
    [
        [Chunk("a", (0, 0), (2, 6))],  # half the rows
        [Chunk("a", (0, 0), (4, 3))],  # one TP rank's half
        [Chunk("a", (0, 0), (4, 6), (0, 10)), Chunk("a", (0, 0), (4, 6), (12, 24))],  # a DP rank's flat range
        [],  # no chunk at all
    ],
)
def test_missing_source_chunk_is_a_coverage_error(chunks: list[Chunk]) -> None:
    with pytest.raises(PlanError) as e:
        plan_reshard(_ptc(A, chunks), A, {0: WHOLE})
    assert "'a'" in str(e.value) and "cover" in str(e.value)


@pytest.mark.parametrize(
    "chunks",
    [
        # overlapping boxes that add up to the full element count (a gap hides behind the overlap)
        [Chunk("a", (0, 0), (2, 6)), Chunk("a", (1, 0), (2, 6))],
        [Chunk("a", (0, 0), (4, 4)), Chunk("a", (0, 3), (4, 2))],
        # overlapping flat ranges of one box (the distributed optimizer's shape), again totalling 24
        [Chunk("a", (0, 0), (4, 6), (0, 14)), Chunk("a", (0, 0), (4, 6), (12, 22))],
        # a flat range overlapping a box
        [Chunk("a", (0, 0), (4, 6), (0, 12)), Chunk("a", (1, 0), (2, 6))],
    ],
)
def test_overlapping_source_chunks_are_refused(chunks: list[Chunk]) -> None:
    with pytest.raises(PlanError) as e:
        plan_reshard(_ptc(A, chunks), A, {0: WHOLE})
    assert "'a'" in str(e.value) and "overlap" in str(e.value)


def test_tensor_missing_from_checkpoint_is_named() -> None:
    dst = {**A, "b": TensorMeta("b", (3,), "float32")}
    with pytest.raises(PlanError) as e:
        plan_reshard(_ptc(A, WHOLE), dst, {0: [*WHOLE, Chunk("b", (0,), (3,))]})
    assert "'b'" in str(e.value) and "not in the checkpoint" in str(e.value)


def test_destination_chunk_without_metadata_is_named() -> None:
    with pytest.raises(PlanError, match="'zz'.*no tensor metadata"):
        plan_reshard(_ptc(A, WHOLE), A, {0: [Chunk("zz", (0,), (3,))]})


@pytest.mark.parametrize(
    "chunk",
    [Chunk("a", (2, 0), (4, 6)), Chunk("a", (0, 0), (4, 6), (0, 25)), Chunk("a", (0,), (4,))],
)
def test_destination_chunk_outside_the_tensor_is_refused(chunk: Chunk) -> None:
    with pytest.raises(PlanError, match="'a'"):
        plan_reshard(_ptc(A, WHOLE), A, {0: [chunk]})


def test_unused_checkpoint_tensors_are_strict_by_default() -> None:
    src = {**A, "old.extra": TensorMeta("old.extra", (2,), "float32")}
    source = _ptc(src, [*WHOLE, Chunk("old.extra", (0,), (2,))])
    with pytest.raises(PlanError, match="old.extra"):
        plan_reshard(source, A, {0: WHOLE})
    plan = plan_reshard(source, A, {0: WHOLE}, strict=False)
    assert plan.unused_tensors == ("old.extra",)
    assert plan.ranks[0].bytes_read == 24 * 4


def test_a_rank_with_no_chunks_reads_nothing() -> None:
    plan = plan_reshard(_ptc(A, WHOLE), A, {0: WHOLE, 1: []})
    assert plan.ranks[1].pieces == () and plan.ranks[1].bytes_read == 0
    assert plan.bytes_per_rank() == {0: 96, 1: 0}


# ---------------------------------------------------------------------------------------------------------------
# Random partitions (grid cuts, then flat cuts) of random small tensors, executed
# ---------------------------------------------------------------------------------------------------------------


def _random_partition(rng: random.Random, key: str, shape: tuple[int, ...]) -> list[Chunk]:
    cuts = []
    for n in shape:
        inner = sorted(rng.sample(range(1, n), rng.randint(0, min(n - 1, 3)))) if n > 1 else []
        cuts.append([0, *inner, n])
    chunks = []
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        off = tuple(c[i] for c, i in zip(cuts, idx))
        shp = tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx))
        n = math.prod(shp)
        if rng.random() < 0.5 or n < 2:
            chunks.append(Chunk(key, off, shp, rng.choice([None, (0, n)])))
        else:  # the distributed optimizer's flat ranges of the box
            bounds = sorted({0, n, *rng.sample(range(1, n), rng.randint(1, min(n - 1, 3)))})
            chunks += [Chunk(key, off, shp, (a, b)) for a, b in zip(bounds, bounds[1:])]
    return chunks


def _mixed_partition(rng: random.Random, key: str, shape: tuple[int, ...]) -> list[Chunk]:
    """Flat ranges of the whole tensor, some of them (whole rows) given as row boxes instead: overlapping boxes."""
    n = math.prod(shape)
    inner = n // shape[0]
    row_cuts = rng.sample(range(1, shape[0]), rng.randint(0, min(shape[0] - 1, 2))) if shape[0] > 1 else []
    other = rng.sample(range(1, n), rng.randint(0, min(n - 1, 3))) if n > 1 else []
    bounds = sorted({0, n, *(r * inner for r in row_cuts), *other})
    out = []
    zeros = (0,) * len(shape)
    for a, b in zip(bounds, bounds[1:]):
        if a % inner == 0 and b % inner == 0 and rng.random() < 0.6:
            out.append(Chunk(key, (a // inner, *zeros[1:]), ((b - a) // inner, *shape[1:])))
        else:
            out.append(Chunk(key, zeros, shape, (a, b)))
    return out


def test_random_partitions_are_rebuilt_exactly() -> None:
    rng = random.Random(2024)
    for case in range(400):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 6) for _ in range(ndim))
        vocab = rng.random() < 0.4
        src_shape, dst_shape = shape, shape
        rows = None
        if vocab:  # dim 0 is a padded vocabulary whose padding differs between source and destination
            rows = rng.randint(1, shape[0])
            dst_shape = (rng.randint(rows, shape[0] + 3), *shape[1:])
        src_t = {"t": TensorMeta("t", src_shape, "float32", vocab_rows=rows)}
        dst_t = {"t": TensorMeta("t", dst_shape, "float32", vocab_rows=rows)}
        src_chunks = rng.choice([_random_partition, _mixed_partition])(rng, "t", src_shape)
        full = global_value(src_t["t"])
        stored, data = [], {}
        for i, c in enumerate(src_chunks):
            for r in range(rng.randint(1, 2)):  # sometimes two replicas
                loc = Location(f"f{i}_{r}", "x", rank=rng.randint(0, 3), host=f"h{rng.randint(0, 1)}")
                stored.append(StoredChunk(c, loc))
                data[loc] = chunk_data(full, c)
        source = PTC(src_t, tuple(stored))
        dst_all = rng.choice([_random_partition, _mixed_partition])(rng, "t", dst_shape)
        dst_chunks: dict[int, list[Chunk]] = {r: [] for r in range(3)}
        for c in dst_all:
            dst_chunks[rng.randint(0, 2)].append(c)
        plan = plan_reshard(source, dst_t, dst_chunks, hosts={r: f"h{r % 2}" for r in range(3)})
        expect, mask = expected_global(src_t["t"], dst_t["t"])
        for rank, rp in plan.ranks.items():
            out, filled = execute(plan, rank, data)
            n_fill = 0
            for c, got in zip(rp.chunks, out):
                np.testing.assert_array_equal(got, chunk_data(expect, c), err_msg=f"case {case}: {c}")
                n_fill += int(chunk_data(mask, c).sum())
            assert filled == n_fill
            assert rp.bytes_read == (sum(c.numel for c in rp.chunks) - n_fill) * 4
            assert Planner(source, dst_t).rank_bytes(rank, list(rp.chunks))[0] == rp.bytes_read


def test_many_narrow_source_chunks() -> None:
    """A wide TP split (16 column chunks, each further cut by DP) puts many rectangles in one row band."""
    meta = {"w": TensorMeta("w", (4, 64), "float32", tp_axis=1)}
    full = global_value(meta["w"])
    stored, data = [], {}
    for col in range(16):
        for a, b in ((0, 5), (5, 16)):
            c = Chunk("w", (0, col * 4), (4, 4), (a, b))
            loc = Location(f"r{col}", f"{a}", col)
            stored.append(StoredChunk(c, loc))
            data[loc] = chunk_data(full, c)
    source = PTC(meta, tuple(stored))
    dst = {
        0: [Chunk("w", (0, 0), (4, 64), (0, 100))],
        1: [Chunk("w", (0, 0), (4, 64), (100, 256))],
        2: [Chunk("w", (1, 3), (2, 50))],
        3: [Chunk("w", (0, 0), (4, 32)), Chunk("w", (0, 32), (4, 32), (7, 120))],
    }
    plan = plan_reshard(source, meta, dst)
    for rank, rp in plan.ranks.items():
        out, _ = execute(plan, rank, data)
        for c, got in zip(rp.chunks, out):
            np.testing.assert_array_equal(got, chunk_data(full, c))
        assert rp.bytes_read == sum(c.numel for c in rp.chunks) * 4
