"""Dry run of a re-shard for a model with no checkpoint: the bytes each destination rank would read. Pure Python.

The source is what a tenplex save at the old layout would write (``shard_layout``);
the destination chunks come as runs, and a run that several ranks hold alike (the
DP replicas of a model-parallel rank) is planned once and counted for each of them,
so a 1024-GPU plan of GPT-3 175B takes a fraction of a second. Routed experts are described in boxes of
consecutive layers and experts that both layouts' stages and EP ranks hold whole (the same bytes as one box per expert, in fewer chunks).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tenplex_megatron.plan.gc_pause import gc_paused
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.planner import Planner
from tenplex_megatron.plan.ptc import Chunk, dtype_size
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors
from tenplex_megatron.plan.sim.sharding import Run, layout_runs, resize_vocab, source_from_layout


@dataclass(frozen=True)
class DryRun:
    """What a re-shard from ``src`` to ``dst`` would move; ``cross_node`` is None without a node size."""

    state_bytes: int  # the checkpoint: every stored chunk once
    read_bytes: dict[int, int]  # destination rank -> bytes it reads
    cross_node: dict[int, int] | None  # destination rank -> bytes it reads from another node's writer
    dst_bytes: int  # every destination rank's chunks (what a central gather-then-scatter would send out)
    padded_vocab: int
    describe_seconds: float
    plan_seconds: float

    @property
    def central_bytes(self) -> int:
        """Bytes through one rank that gathers the whole state and scatters every rank's part."""
        return self.state_bytes + self.dst_bytes


def dry_run(
    dims: GPTDims,
    src: ParallelLayout,
    dst: ParallelLayout,
    distributed_optimizer: bool,
    gpus_per_node: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> DryRun:
    """Describe both layouts from the model's dimensions, plan the re-shard, total the bytes; timed in two parts."""
    with gc_paused():  # ~10^5 chunk objects: full collections would cost as much as the planning
        return _dry_run(dims, src, dst, distributed_optimizer, gpus_per_node, make_vocab_size_divisible_by)


def _dry_run(
    dims: GPTDims, src: ParallelLayout, dst: ParallelLayout, distributed_optimizer: bool, gpus_per_node: int | None,
    make_vocab_size_divisible_by: int,
) -> DryRun:
    t0 = time.perf_counter()
    div = make_vocab_size_divisible_by
    saved_vocab = padded_vocab_size(dims.vocab_size, div, src.tp)
    tensors = gpt_tensors(dims, saved_vocab)
    group = expert_group(dims, src, dst)
    source = source_from_layout(tensors, src, distributed_optimizer, group)
    padded = restart_padded_vocab_size(dims.vocab_size, div, dst.tp, saved_vocab)
    dst_tensors = resize_vocab(tensors, padded)
    runs = _distinct_runs(layout_runs(dst_tensors, dst, distributed_optimizer, group))
    t1 = time.perf_counter()

    planner = Planner(source, dst_tensors)
    planner.check_keys(set(dst_tensors), strict=True)
    per_rank = planner.runs_bytes(runs, gpus_per_node=gpus_per_node)
    state = source.total_bytes()
    itemsize = {k: dtype_size(t.dtype) for k, t in dst_tensors.items()}
    dst_bytes = sum(len(ranks) * sum(c.numel * itemsize[c.key] for c in chunks) for chunks, ranks in runs)
    return DryRun(
        state_bytes=state,
        read_bytes={r: per_rank[r][0] for r in sorted(per_rank)},
        cross_node={r: per_rank[r][1] for r in sorted(per_rank)} if gpus_per_node else None,
        dst_bytes=dst_bytes,
        padded_vocab=padded,
        describe_seconds=t1 - t0,
        plan_seconds=time.perf_counter() - t1,
    )


def expert_group(dims: GPTDims, src: ParallelLayout, dst: ParallelLayout) -> tuple[int, int]:
    """(layers, experts) per routed-expert box for a dry run: the most that both layouts' pipeline stages and EP ranks
    hold whole ((1, 1) for a dense model)."""
    if not dims.num_experts:
        return 1, 1
    counts = [len(lay.layers(dims.num_layers, r, v)) for lay in (src, dst) for r in range(lay.pp)
              for v in range(lay.vpp)]
    return math.gcd(*counts) or 1, math.gcd(dims.num_experts // src.ep, dims.num_experts // dst.ep)


def _distinct_runs(runs: dict[int, tuple[Run, ...]]) -> list[tuple[tuple[Chunk, ...], list[int]]]:
    """Each distinct chunk run once, with every rank holding it (ranks share one tuple object per run)."""
    by_id: dict[int, tuple[tuple[Chunk, ...], list[int]]] = {}
    for rank, rank_runs in runs.items():
        for run in rank_runs:
            got = by_id.get(id(run.chunks))
            if got is None:
                by_id[id(run.chunks)] = (run.chunks, [rank])
            else:
                got[1].append(rank)
    return list(by_id.values())
