"""The fast dry run equals the frozen slow reference on a seeded matrix of random small models and layouts.

``test_plan_fast.py`` checks hand-picked cases; this draws many more (model shapes
with odd vocabularies, SwiGLU, untied embeddings, fp32 or bf16; TP, PP and DP
changed alone or together; several node sizes) and compares every rank's bytes
read and cross-node bytes, the state and the central baseline with the reference.
No expected number is written here: both sides are computed.
"""

from __future__ import annotations

import random
from dataclasses import astuple

import pytest

from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.planner import Planner, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Location, StoredChunk
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors
from tests.unit import reference_plan as ref


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout(rng: random.Random, dims: GPTDims) -> ParallelLayout:
    return ParallelLayout(rng.choice(_divisors(dims.num_attention_heads)), rng.choice(_divisors(dims.num_layers)),
                          rng.randint(1, 4))


def _cases(n: int, seed: int = 4) -> list[tuple[GPTDims, ParallelLayout, ParallelLayout, bool, int | None]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        heads = rng.choice([2, 4, 6, 8])
        dims = GPTDims(num_layers=rng.choice([2, 3, 4, 6, 8]), hidden_size=heads * rng.choice([2, 4]),
                       num_attention_heads=heads, vocab_size=rng.randint(20, 400), seq_length=rng.choice([8, 16]),
                       swiglu=rng.random() < 0.5, tied=rng.random() < 0.7, bf16=rng.random() < 0.7)
        src, dst = _layout(rng, dims), _layout(rng, dims)
        out.append((dims, src, dst, rng.random() < 0.8, rng.choice([None, 1, 2, 3, 4, 8])))
    return out


@pytest.mark.parametrize("dims,src,dst,distopt,gpus_per_node", _cases(40))
def test_dry_run_matches_the_reference(dims, src, dst, distopt, gpus_per_node) -> None:
    got = dry_run(dims, src, dst, distopt, gpus_per_node)
    want = ref.model_report(dims, src, dst, distopt, gpus_per_node)
    assert got.state_bytes == want["state_bytes"]
    assert got.read_bytes == {r: b for r, (b, _) in want["per_rank"].items()}
    if gpus_per_node:
        assert got.cross_node == {r: c for r, (_, c) in want["per_rank"].items()}
    else:
        assert got.cross_node is None
    assert got.central_bytes == want["central_bytes_through_one_rank"]


def _replicated(source: PTC, copies: int) -> PTC:
    """``source`` with every chunk also stored at ``copies - 1`` other ranks (on hosts of two ranks each)."""
    world = max(sc.location.rank for sc in source.chunks) + 1
    stored = []
    for n, sc in enumerate(source.chunks):
        for k in range(copies):
            rank = (sc.location.rank + k * (n % 3 + 1)) % (world + 2)
            stored.append(StoredChunk(sc.chunk, Location(f"rank_{rank:05d}.safetensors", sc.location.name, rank, f"h{rank // 2}")))
    return PTC(source.tensors, tuple(stored), source.layout)


@pytest.mark.parametrize("dims,src,dst,distopt,gpus_per_node", _cases(12, seed=9))
def test_replicated_sources_choose_like_the_reference(dims, src, dst, distopt, gpus_per_node) -> None:
    """Sources with several locations: the replica each rank reads (local host first, then a rotation)."""
    tensors = gpt_tensors(dims, padded_vocab_size(dims.vocab_size, 128, src.tp))
    source = _replicated(ref.source_from_layout(tensors, src, distopt), 3)
    padded = restart_padded_vocab_size(dims.vocab_size, 128, dst.tp, tensors["embedding.word_embeddings.weight"].global_shape[0])
    dst_tensors = ref.resize_vocab(tensors, padded)
    chunks = ref.layout_chunks(dst_tensors, dst, distopt)
    hosts = {r: f"h{r // 2}" if r % 3 else "" for r in chunks}
    planner, ref_planner = Planner(source, dst_tensors), ref.Planner(source, dst_tensors)
    for r, cs in chunks.items():
        assert planner.rank_bytes(r, cs, hosts[r], gpus_per_node) == ref_planner.rank_bytes(r, cs, hosts[r], gpus_per_node)
    some = sorted({0, dst.world_size // 2, dst.world_size - 1})
    got = plan_reshard(source, dst_tensors, chunks, hosts=hosts, ranks=some)
    want = ref.plan_reshard(source, dst_tensors, chunks, hosts=hosts, ranks=some)
    for r in some:
        g, w = got.ranks[r], want.ranks[r]
        assert (g.chunks, g.bytes_read, g.bytes_by_file) == (w.chunks, w.bytes_read, w.bytes_by_file)
        assert [astuple(p) for p in g.pieces] == [astuple(p) for p in w.pieces]
        assert [astuple(f) for f in g.fills] == [astuple(f) for f in w.fills]
