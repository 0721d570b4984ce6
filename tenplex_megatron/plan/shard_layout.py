"""Where every rank's chunks lie at a layout, from layout-independent tensor metadata. Pure Python.

This mirrors megatron-core's sharding so that a plan can be made without
building the model: TP splits ``tp_axis`` in ``tp_parts`` groups (SwiGLU's fc1
is two), PP splits the layer axis evenly, the embedding lives on the first
stage (and, tied, on the last), the final norm and output layer on the last.
Under the distributed optimizer each model-parallel rank's parameters are laid
end to end in one buffer, padded to a multiple of DP, and each DP rank owns a
contiguous 1/DP of it. Megatron-core orders and pads its buckets its own way,
so per-rank flat boundaries here can differ from a live job's; the bytes per
rank and in total are the same to within the padding. A live job always plans
from its own described chunks, never from this model.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta, dtype_size
from tenplex_megatron.plan.writers import Holding, assign_writers


def resize_vocab(tensors: dict[str, TensorMeta], padded_vocab: int) -> dict[str, TensorMeta]:
    """The same tensors with every padded-vocabulary dimension set to ``padded_vocab``."""
    out = {}
    for k, t in tensors.items():
        if t.vocab_rows is not None and t.global_shape[0] != padded_vocab:
            t = replace(t, global_shape=(padded_vocab, *t.global_shape[1:]))
        out[k] = t
    return out


def _stage_holds(t: TensorMeta, pp_rank: int, pp: int) -> bool:
    if t.stage == "last":
        return pp_rank == pp - 1
    if t.stage == "first":
        return pp_rank == 0 or (t.tied and pp_rank == pp - 1)
    return pp_rank == 0  # unknown placement: assume the first stage


def _tp_boxes(t: TensorMeta, offsets: list[int], shape: list[int], tp: int, tp_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if t.tp_axis is None or tp == 1 and t.tp_parts == 1:
        return [(tuple(offsets), tuple(shape))]
    axis = t.tp_axis
    size = t.global_shape[axis]
    if size % (t.tp_parts * tp):
        raise LayoutError(
            f"tensor {t.key!r}: TP={tp} does not divide dimension {axis} of size {size} "
            f"({t.tp_parts} part(s))"
        )
    part = size // t.tp_parts
    per = part // tp
    boxes = []
    for g in range(t.tp_parts):
        off = list(offsets)
        shp = list(shape)
        off[axis] = g * part + tp_rank * per
        shp[axis] = per
        boxes.append((tuple(off), tuple(shp)))
    return boxes


def _local_params(t: TensorMeta, layout: ParallelLayout, tp_rank: int, pp_rank: int) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """This model-parallel rank's parameters of tensor ``t``: one list of part boxes per parameter."""
    shape = list(t.global_shape)
    zeros = [0] * len(shape)
    if t.stage == "layers":
        layers = shape[0]
        if layers % layout.pp:
            raise LayoutError(f"PP={layout.pp} does not divide the number of layers ({layers})")
        per = layers // layout.pp
        out = []
        for layer in range(pp_rank * per, (pp_rank + 1) * per):
            off = [layer, *zeros[1:]]
            out.append(_tp_boxes(t, off, [1, *shape[1:]], layout.tp, tp_rank))
        return out
    if not _stage_holds(t, pp_rank, layout.pp):
        return []
    return [_tp_boxes(t, zeros, shape, layout.tp, tp_rank)]


def layout_holdings(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[tuple[Chunk, bool]]]:
    """Every rank's chunks at ``layout`` (megatron-core's rank order), each with megatron's main-replica flag.

    Main: DP rank 0 for DP-replicated chunks, TP rank 0 for TP-replicated ones,
    never the last stage's copy of a tied embedding.
    """
    params = {k: t for k, t in tensors.items() if t.param is None}
    states: dict[str, list[TensorMeta]] = {}
    for t in tensors.values():
        if t.param is not None:
            states.setdefault(t.param, []).append(t)
    out: dict[int, list[tuple[Chunk, bool]]] = {}
    cache: dict[tuple[int, int], dict[str, list[list[tuple]]]] = {}
    made: dict[tuple, list] = {}
    for rank in range(layout.world_size):
        tp_rank, pp_rank, dp_rank = layout.rank_coords(rank)
        key = (tp_rank, pp_rank)
        if key not in cache:
            cache[key] = {k: _local_params(t, layout, tp_rank, pp_rank) for k, t in sorted(params.items())}
        local = cache[key]
        tied_copy = layout.pp > 1 and pp_rank == layout.pp - 1

        def main(t: TensorMeta, dp_replicated: bool, tied_copy=tied_copy, tp_rank=tp_rank, dp_rank=dp_rank) -> bool:
            if t.tied and tied_copy:
                return False
            if t.tp_axis is None and tp_rank != 0:
                return False
            return dp_rank == 0 or not dp_replicated

        chunks: list[tuple[Chunk, bool]] = []
        keys = list(local) if not distributed_optimizer else []
        replicated = [(k, params[k]) for k in local] + [(st.key, st) for k in keys for st in states.get(k, [])]
        if (key, "chunks") not in made:  # chunk objects shared by the DP replicas of a (TP, PP) rank
            made[(key, "chunks")] = [
                (name, [Chunk(name, off, shp) for boxes in local[t.param or name] for off, shp in boxes])
                for name, t in replicated
            ]
        for (_, cs), (_, t) in zip(made[(key, "chunks")], replicated):
            m = main(t, True)
            chunks.extend((c, m) for c in cs)
        if distributed_optimizer:
            chunks.extend((c, main(tensors[c.key], False)) for c in _dist_opt_chunks(local, states, layout.dp, dp_rank))
        out[rank] = chunks
    return out


def layout_chunks(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[Chunk]]:
    """Every rank's chunks at ``layout`` (ranks in megatron-core's order)."""
    return {r: [c for c, _ in hs] for r, hs in layout_holdings(tensors, layout, distributed_optimizer).items()}


def source_from_layout(tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool) -> PTC:
    """The PTC a tenplex save at ``layout`` would write: each main chunk once, writers balanced."""
    holdings = [
        Holding(rank, c, main, c.numel * dtype_size(tensors[c.key].dtype))
        for rank, hs in layout_holdings(tensors, layout, distributed_optimizer).items()
        for c, main in hs
    ]
    writers = assign_writers(holdings)
    stored = tuple(
        StoredChunk(c, Location(f"rank_{w:05d}.safetensors", f"{c.key}@{c.offsets}#{c.flat}", w)) for c, w in writers.items()
    )
    return PTC(tensors, stored, layout.to_json())


def _dist_opt_chunks(
    local: dict[str, list[list[tuple]]], states: dict[str, list[TensorMeta]], dp: int, dp_rank: int
) -> list[Chunk]:
    entries = [(k, boxes) for k, plist in local.items() if states.get(k) for boxes in plist]
    sizes = [sum(math.prod(shp) for _, shp in boxes) for _, boxes in entries]
    total = sum(sizes)
    padded = -(-total // dp) * dp
    lo, hi = dp_rank * padded // dp, (dp_rank + 1) * padded // dp
    out: list[Chunk] = []
    pos = 0
    for (k, boxes), n in zip(entries, sizes):
        a, b = max(lo, pos) - pos, min(hi, pos + n) - pos
        pos += n
        if a >= b:
            continue
        part_lo = 0
        for off, shp in boxes:
            m = math.prod(shp)
            s, e = max(a, part_lo), min(b, part_lo + m)
            if s < e:
                flat = None if (s - part_lo, e - part_lo) == (0, m) else (s - part_lo, e - part_lo)
                out.extend(Chunk(st.key, off, shp, flat) for st in states[k])
            part_lo += m
    return out
