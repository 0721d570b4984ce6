"""Property tests of the planner (hypothesis): random GPT shapes, random source and destination layouts.

Source and destination chunks come from the pure layout model (``shard_layout``,
which the multi-process tests check against megatron-core itself), with the
distributed optimizer's flat ranges or without. The plan is executed with numpy
on a global tensor whose every element is distinct; then:
every destination element holds exactly its global value (or zero for new
vocabulary padding), no piece reads or writes out of bounds, the bytes read
equal the minimum (each destination element read once), and every rank planning
only for itself gets the same plan as the whole.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.planner import Planner, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import layout_chunks, resize_vocab


def gpt_tensors(layers: int, hidden: int, ffn: int, vocab: int, padded: int, swiglu: bool, tied: bool) -> dict[str, TensorMeta]:
    f1 = 2 * ffn if swiglu else ffn
    params = [
        TensorMeta("embedding.word_embeddings.weight", (padded, hidden), "float32", vocab, 0, 1, "first", tied),
        TensorMeta("embedding.position_embeddings.weight", (6, hidden), "float32", stage="first"),
        TensorMeta("decoder.layers.qkv.weight", (layers, 3 * hidden, hidden), "float32", tp_axis=1, stage="layers"),
        TensorMeta("decoder.layers.proj.weight", (layers, hidden, hidden), "float32", tp_axis=2, stage="layers"),
        TensorMeta("decoder.layers.fc1.weight", (layers, f1, hidden), "float32", tp_axis=1,
                   tp_parts=2 if swiglu else 1, stage="layers"),
        TensorMeta("decoder.layers.fc2.weight", (layers, hidden, ffn), "float32", tp_axis=2, stage="layers"),
        TensorMeta("decoder.layers.norm.weight", (layers, hidden), "float32", stage="layers"),
        TensorMeta("decoder.final_layernorm.weight", (hidden,), "float32", stage="last"),
    ]
    if not tied:
        params.append(TensorMeta("output_layer.weight", (padded, hidden), "float32", vocab, 0, 1, "last"))
    out = {t.key: t for t in params}
    for t in params:
        for name in ("exp_avg", "exp_avg_sq"):
            k = f"optimizer.state.{name}.{t.key}"
            out[k] = TensorMeta(k, t.global_shape, t.dtype, t.vocab_rows, t.tp_axis, t.tp_parts, t.stage, t.tied, t.key)
    return out


def global_value(meta: TensorMeta) -> np.ndarray:
    base = zlib.crc32(meta.key.encode()) % 1000 * 1_000_000
    return (np.arange(meta.numel, dtype=np.float64) + base).reshape(meta.global_shape)


def chunk_data(full: np.ndarray, c: Chunk) -> np.ndarray:
    box = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))].reshape(-1)
    a, b = c.flat_range
    return box[a:b].copy()


def source_ptc(tensors: dict[str, TensorMeta], layout: ParallelLayout, distopt: bool) -> tuple[PTC, dict]:
    stored: dict[Chunk, StoredChunk] = {}
    for rank, chunks in layout_chunks(tensors, layout, distopt).items():
        last_stage_copy = layout.pp > 1 and layout.rank_coords(rank)[1] == layout.pp - 1
        for c in chunks:
            if tensors[c.key].tied and last_stage_copy:
                continue  # megatron marks the last stage's tied copy a non-main replica: never saved
            if c not in stored:
                name = f"{c.key}@{c.offsets}#{c.flat}"
                stored[c] = StoredChunk(c, Location(f"rank_{rank}", name, rank, f"h{rank // 2}"))
    data = {sc.location.name: chunk_data(global_value(tensors[c.key]), c) for c, sc in stored.items()}
    return PTC(tensors, tuple(stored.values()), layout.to_json()), data


layouts = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]))


@settings(max_examples=60, deadline=None)
@given(
    layers=st.sampled_from([2, 4]),
    hidden=st.sampled_from([4, 8]),
    ffn_mult=st.sampled_from([1, 2]),
    vocab=st.integers(5, 40),
    div=st.sampled_from([1, 2, 4]),
    swiglu=st.booleans(),
    tied=st.booleans(),
    src=layouts,
    dst=layouts,
    src_distopt=st.booleans(),
    dst_distopt=st.booleans(),
)
def test_plan_is_exact_minimal_and_identical_on_every_rank(
    layers, hidden, ffn_mult, vocab, div, swiglu, tied, src, dst, src_distopt, dst_distopt
) -> None:
    src_l, dst_l = ParallelLayout(*src), ParallelLayout(*dst)
    ffn = hidden * ffn_mult
    src_t = gpt_tensors(layers, hidden, ffn, vocab, padded_vocab_size(vocab, div, src_l.tp), swiglu, tied)
    source, data = source_ptc(src_t, src_l, src_distopt)
    dst_padded = padded_vocab_size(vocab, div, dst_l.tp)
    dst_t = resize_vocab(src_t, dst_padded)
    dst_chunks = layout_chunks(dst_t, dst_l, dst_distopt)
    hosts = {r: f"h{r // 2}" for r in dst_chunks}
    plan = plan_reshard(source, dst_t, dst_chunks, hosts=hosts)

    for rank, rp in plan.ranks.items():
        assert plan_reshard(source, dst_t, dst_chunks, hosts=hosts, ranks=[rank]).ranks[rank] == rp
        out = [np.full(c.numel, np.nan) for c in rp.chunks]
        for p in rp.pieces:
            sc = plan.sources[p.source]
            src_flat = data[sc.location.name]
            assert p.src_start >= 0 and p.src_start + math.prod(p.src_rect) <= src_flat.size
            assert all(o + s <= r for o, s, r in zip(p.src_sel, p.shape, p.src_rect))
            assert all(o + s <= r for o, s, r in zip(p.dst_sel, p.shape, p.dst_rect))
            assert p.dst_start + math.prod(p.dst_rect) <= out[p.dst].size
            s = src_flat[p.src_start : p.src_start + math.prod(p.src_rect)].reshape(p.src_rect)
            d = out[p.dst][p.dst_start : p.dst_start + math.prod(p.dst_rect)].reshape(p.dst_rect)
            view = d[tuple(slice(o, o + n) for o, n in zip(p.dst_sel, p.shape))]
            assert np.isnan(view).all(), "an element is written twice"
            view[...] = s[tuple(slice(o, o + n) for o, n in zip(p.src_sel, p.shape))]
        for f in rp.fills:
            d = out[f.dst][f.dst_start : f.dst_start + math.prod(f.dst_rect)].reshape(f.dst_rect)
            view = d[tuple(slice(o, o + n) for o, n in zip(f.dst_sel, f.shape))]
            assert np.isnan(view).all(), "an element is written twice"
            view[...] = 0
        filled = 0
        for c, got in zip(rp.chunks, out):
            meta = dst_t[c.key]
            expect = global_value(meta)
            if meta.vocab_rows is not None and meta.global_shape != src_t[c.key].global_shape:
                src_full = global_value(src_t[c.key])
                expect = np.zeros(meta.global_shape)
                expect[:vocab] = src_full[:vocab]
                filled += int(np.sum(chunk_data(np.arange(meta.numel).reshape(meta.global_shape) // meta.global_shape[1] >= vocab, c)))
            np.testing.assert_array_equal(got, chunk_data(expect, c))
        assert rp.bytes_read == (sum(c.numel for c in rp.chunks) - filled) * 4
        assert Planner(source, dst_t).rank_bytes(rank, list(rp.chunks), gpus_per_node=2)[0] == rp.bytes_read
