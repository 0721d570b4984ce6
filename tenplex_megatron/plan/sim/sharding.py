"""Where every rank's chunks lie at a layout, from layout-independent tensor metadata. Pure Python.

This mirrors megatron-core's sharding so that a plan can be made without
building the model: TP splits ``tp_axis`` in ``tp_parts`` groups (SwiGLU's fc1
is two), PP x VPP splits the layer axis evenly or as the layout's uneven split says
(pipeline rank r holds virtual stages r, r + PP, ...), the embedding lives on the first
stage (and, tied, on the last), the final norm and output layer on the last.
A routed expert's tensor (layer, expert, ...) is split whole along the expert axis by EP (EP rank r holds experts
r E/EP to (r + 1) E/EP - 1, one box per expert as megatron-core's SequentialMLP describes them, or one box for all of
them, a GroupedMLP parameter) and by the experts' own TP; at EP > 1 the experts have a replica group (expert DP) and an optimizer buffer of their own.
Under the distributed optimizer each model-parallel rank's parameters are laid
end to end in one buffer, padded to a multiple of DP, and each DP rank owns a
contiguous 1/DP of it. Megatron-core orders and pads its buckets its own way,
so per-rank flat boundaries here can differ from a live job's; the bytes per
rank and in total are the same to within the padding. A live job always plans
from its own described chunks, never from this model.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta, dtype_size
from tenplex_megatron.plan.sim.gpt_catalogue import is_expert, is_grouped
from tenplex_megatron.plan.writers import assign_grouped


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


def _local_params(t: TensorMeta, layout: ParallelLayout, tp_rank: int, pp_rank: int, ep_rank: int = 0,
                  expert_group: tuple[int, int] = (1, 1)) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """This model-parallel rank's parameters of tensor ``t``: one list of part boxes per parameter. For a routed
    expert's tensor ``tp_rank`` is the expert TP rank and each of the EP rank's experts is a parameter of its own
    (``expert_group`` (layers, experts): one box spans that many consecutive layers and experts, for dry runs)."""
    shape = list(t.global_shape)
    zeros = [0] * len(shape)
    if t.stage == "layers":  # PP x VPP chunks (even, or the layout's split); pipeline rank r holds r, r + PP, ...
        chunks = [layout.layers(shape[0], pp_rank, v) for v in range(layout.vpp)]
        expert = is_expert(t)
        group_layers, group_experts = expert_group if expert else (1, 1)
        if expert and shape[1] % (layout.ep * group_experts):
            raise LayoutError(f"tensor {t.key!r}: EP={layout.ep} does not divide its {shape[1]} experts"
                              + (f" in groups of {group_experts}" if group_experts > 1 else ""))
        if any(len(c) % group_layers for c in chunks):
            raise LayoutError(f"tensor {t.key!r}: a stage's {[len(c) for c in chunks]} layers do not split into groups "
                              f"of {group_layers}")
        local = shape[1] // layout.ep if expert else 0
        if expert and is_grouped(t):  # GroupedMLP: one parameter holds all of the EP rank's experts of a layer
            group_experts = local
        tp = layout.expert_tp if expert else layout.tp
        out = []
        for chunk in chunks:
            for layer in chunk[::group_layers]:
                if not expert:
                    out.append(_tp_boxes(t, [layer, *zeros[1:]], [1, *shape[1:]], tp, tp_rank))
                    continue
                for e in range(ep_rank * local, (ep_rank + 1) * local, group_experts):
                    out.append(_tp_boxes(t, [layer, e, *zeros[2:]], [group_layers, group_experts, *shape[2:]], tp,
                                         tp_rank))
        return out
    if not _stage_holds(t, pp_rank, layout.pp):
        return []
    return [_tp_boxes(t, zeros, shape, layout.tp, tp_rank)]


def local_param_boxes(t: TensorMeta, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                      ep_rank: int = 0) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The parameters of tensor ``t`` that model-parallel rank (``tp_rank``, ``pp_rank``; for a routed expert's
    tensor the expert TP rank and ``ep_rank``) holds at ``layout``: one list of part boxes (offsets, shape) per
    parameter, parts in the parameter's memory order."""
    return _local_params(t, layout, tp_rank, pp_rank, ep_rank)


@dataclass(frozen=True)
class Run:
    """Consecutive chunks of one rank with megatron's main-replica flag of each.

    Ranks holding the same chunks alike share one Run object (the DP replicas of
    a model-parallel rank share its parameters), so a consumer can handle it once.
    """

    chunks: tuple[Chunk, ...]
    main: tuple[bool, ...]


class _ModelParallelRank:
    """What one (TP, PP) rank holds, worked out once for all of its DP replicas; or, for the routed experts when they
    have a replica group of their own, what one (expert TP, EP, PP) rank holds for all of its expert DP replicas."""

    def __init__(self, tensors: dict[str, TensorMeta], states: dict[str, list[TensorMeta]], layout: ParallelLayout,
                 tp_rank: int, pp_rank: int, distributed_optimizer: bool, ep_rank: int = 0,
                 expert_group: tuple[int, int] = (1, 1)):
        params = sorted((k, t) for k, t in tensors.items() if t.param is None)
        local = {k: _local_params(t, layout, tp_rank, pp_rank, ep_rank, expert_group) for k, t in params}
        tied_copy = layout.pp > 1 and pp_rank == layout.pp - 1

        def main(t: TensorMeta) -> bool:  # before the DP-replica condition
            return not (t.tied and tied_copy) and not (t.tp_axis is None and tp_rank != 0)

        replicated = [t for _, t in params]
        if not distributed_optimizer:
            replicated += [st for k in local for st in states.get(k, [])]
        chunks, flags = [], []
        for t in replicated:
            m = main(t)
            for boxes in local[t.param or t.key]:
                chunks.extend(Chunk(t.key, off, shp) for off, shp in boxes)
                flags.extend(m for _ in boxes)
        self.replicated = Run(tuple(chunks), tuple(flags))  # DP rank 0's: the main replicas
        self.replica = Run(self.replicated.chunks, (False,) * len(chunks))  # every other DP rank's
        # the distributed optimizer's buffer: every parameter's boxes end to end, as
        # (box offsets, box shape, start, stop, [(optimizer state key, main)]) in buffer order
        self.parts: list[tuple[tuple[int, ...], tuple[int, ...], int, int, list[tuple[str, bool]]]] = []
        pos = 0
        for k, plist in local.items():
            if states.get(k):
                flagged = [(st.key, main(st)) for st in states[k]]
                for boxes in plist:
                    for off, shp in boxes:
                        n = math.prod(shp)
                        self.parts.append((off, shp, pos, pos + n, flagged))
                        pos += n
        self.stops = [p[3] for p in self.parts]
        self.total = pos

    def dist_opt_run(self, dp: int, dp_rank: int) -> Run:
        """DP rank ``dp_rank``'s contiguous 1/DP of the buffer (padded to a multiple of DP) as flat chunks."""
        padded = -(-self.total // dp) * dp
        lo, hi = dp_rank * padded // dp, (dp_rank + 1) * padded // dp
        chunks: list[Chunk] = []
        flags: list[bool] = []
        for i in range(bisect.bisect_right(self.stops, lo), len(self.parts)):
            off, shp, start, stop, flagged = self.parts[i]
            if start >= hi:
                break
            if start == stop:  # an empty box holds nothing
                continue
            flat = None if lo <= start and stop <= hi else (max(lo, start) - start, min(hi, stop) - start)
            for key, main in flagged:
                chunks.append(Chunk(key, off, shp, flat))
                flags.append(main)
        return Run(tuple(chunks), tuple(flags))


def layout_runs(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool, expert_group: tuple[int, int] = (1, 1)
) -> dict[int, tuple[Run, ...]]:
    """Every rank's chunks at ``layout`` (megatron-core's rank order) as runs, with megatron's main-replica flags.

    First the DP-replicated run (parameters; optimizer state too without the distributed
    optimizer), one object for all DP ranks but rank 0, and, when the experts have a replica
    group of their own, the expert-DP-replicated run of the rank's experts; then, under the
    distributed optimizer, the rank's own flat ranges of the optimizer state (and of the experts').
    ``expert_group`` (layers, experts): one box per that many consecutive layers and experts instead of one per
    layer and expert (megatron-core's); the same elements and bytes in fewer chunks, which keeps a 256-expert dry run
    fast (flat distributed-optimizer boundaries move, as the module's docstring allows). Main: DP rank 0 for
    DP-replicated chunks, TP rank 0 for TP-replicated ones, never the last stage's copy
    of a tied embedding.
    """
    states: dict[str, list[TensorMeta]] = {}
    for t in tensors.values():
        if t.param is not None:
            states.setdefault(t.param, []).append(t)
    own = separate_experts(layout)  # the experts' replica group (and optimizer buffer) apart from the dense one
    dense = {k: t for k, t in tensors.items() if not (own and is_expert(t))}
    experts = {k: t for k, t in tensors.items() if own and is_expert(t)}
    mp: dict[tuple[int, int], _ModelParallelRank] = {}
    xp: dict[tuple[int, int, int], _ModelParallelRank] = {}
    out: dict[int, tuple[Run, ...]] = {}
    for rank in range(layout.world_size):
        tp_rank, pp_rank, dp_rank = layout.rank_coords(rank)
        m = mp.get((tp_rank, pp_rank))
        if m is None:
            m = mp[(tp_rank, pp_rank)] = _ModelParallelRank(dense, states, layout, tp_rank, pp_rank,
                                                            distributed_optimizer, 0, expert_group)
        runs = [m.replicated if dp_rank == 0 else m.replica]
        opt = [m.dist_opt_run(layout.dp, dp_rank)] if distributed_optimizer else []
        if experts:
            etp_rank, ep_rank, edp_rank = layout.expert_rank_coords(rank)
            x = xp.get((etp_rank, ep_rank, pp_rank))
            if x is None:
                x = xp[(etp_rank, ep_rank, pp_rank)] = _ModelParallelRank(experts, states, layout, etp_rank, pp_rank,
                                                                          distributed_optimizer, ep_rank,
                                                                          expert_group)
            runs.append(x.replicated if edp_rank == 0 else x.replica)
            if distributed_optimizer:
                opt.append(x.dist_opt_run(layout.expert_dp, edp_rank))
        out[rank] = (*runs, *opt)
    return out


def separate_experts(layout: ParallelLayout) -> bool:
    """Whether the routed experts have their own replica group (expert DP) and distributed-optimizer buffer: at
    EP > 1 (megatron-core marks them ``allreduce=False`` then) or with an expert TP other than TP."""
    return layout.ep > 1 or layout.expert_tp != layout.tp


def layout_holdings(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[tuple[Chunk, bool]]]:
    """Every rank's chunks at ``layout`` (megatron-core's rank order), each with megatron's main-replica flag."""
    return {r: [h for run in runs for h in zip(run.chunks, run.main)]
            for r, runs in layout_runs(tensors, layout, distributed_optimizer).items()}


def layout_chunks(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[Chunk]]:
    """Every rank's chunks at ``layout`` (ranks in megatron-core's order)."""
    return {r: run_chunks(runs) for r, runs in layout_runs(tensors, layout, distributed_optimizer).items()}


def run_chunks(runs: tuple[Run, ...]) -> list[Chunk]:
    """The chunks of a rank's runs, in order."""
    out = list(runs[0].chunks) if runs else []
    for run in runs[1:]:
        out += run.chunks
    return out


def source_from_layout(tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool,
                       expert_group: tuple[int, int] = (1, 1)) -> PTC:
    """The PTC a tenplex save at ``layout`` would write: each main chunk once, writers balanced (``expert_group``:
    as in :func:`layout_runs`)."""
    # each distinct chunk tuple once (DP replicas share theirs), with the ranks holding it and any main flag
    held: dict[int, list] = {}
    for rank, runs in layout_runs(tensors, layout, distributed_optimizer, expert_group).items():
        for run in runs:
            got = held.get(id(run.chunks))
            if got is None:
                held[id(run.chunks)] = [run.chunks, [rank], run.main]
            else:
                got[1].append(rank)
                if run.main is not got[2] and any(run.main):  # DP rank 0's flags after another's
                    got[2] = tuple(a or b for a, b in zip(got[2], run.main))
    itemsize = {k: dtype_size(t.dtype) for k, t in tensors.items()}
    holders: dict[Chunk, list] = {}  # chunk -> [chunk, ranks, any main, bytes], in order of first appearance
    for chunks, ranks, mains in held.values():
        for c, main in zip(chunks, mains):
            got = holders.get(c)
            if got is None:
                flat = c.flat
                numel = flat[1] - flat[0] if flat is not None else math.prod(c.shape)  # Chunk.numel, inlined
                holders[c] = [c, list(ranks), main, numel * itemsize[c.key]]
            else:
                got[1].extend(ranks)
                got[2] = got[2] or main
    files: dict[int, str] = {}
    suffixes: dict[tuple, str] = {}  # "@offsets#flat", shared by a parameter's optimizer states
    stored = []
    for c, w in assign_grouped([tuple(h) for h in holders.values()]):
        file = files.get(w)
        if file is None:
            file = files[w] = f"rank_{w:05d}.safetensors"
        suffix = suffixes.get((c.offsets, c.flat))
        if suffix is None:
            suffix = suffixes[(c.offsets, c.flat)] = f"@{c.offsets}#{c.flat}"
        stored.append(StoredChunk(c, Location(file, c.key + suffix, w)))
    return PTC(tensors, tuple(stored), layout.to_json())
