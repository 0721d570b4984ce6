"""What a checkpoint holds of a mixture of experts: the expert count, EP / expert TP / expert DP, which routed
experts are stored incompletely (an expert-parallel save that dropped experts), and which kind of experts wrote
them. Pure Python.

A routed expert's tensor stacks (layer, expert) on its first two axes (megatron-core's ``SequentialMLP``:
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape (layers, experts, ...); its ``GroupedMLP``,
``--moe-grouped-gemm``: ``decoder.layers.mlp.experts.weight1`` and ``weight2`` in the parameters' own memory order,
see ``integrations/megatron_core/grouped.py``), so each (layer, expert) pair's elements can be counted from the
stored chunks alone, without a model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.planner import PlanError
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.plan.sim.gpt_catalogue import EXPERTS, GROUPED_SUFFIXES


@dataclass(frozen=True)
class ExpertSummary:
    """A mixture-of-experts checkpoint's experts: count per layer, the layout's EP, expert TP and expert DP, the
    routed-expert tensors, and per tensor the (layer, expert) pairs not stored in full (empty: every expert present)."""

    num_experts: int
    ep: int
    expert_tp: int
    expert_dp: int
    tensors: tuple[str, ...]
    missing: dict[str, tuple[tuple[int, int], ...]]

    @property
    def complete(self) -> bool:
        return not any(self.missing.values())

    def to_json(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "ep": self.ep, "expert_tp": self.expert_tp,
                "expert_dp": self.expert_dp, "expert_tensors": len(self.tensors), "complete": self.complete,
                "missing": {k: [list(p) for p in v] for k, v in self.missing.items() if v}}

    def line(self) -> str:
        """One line for ``inspect`` and ``verify``."""
        what = "every expert stored in full" if self.complete else (
            f"{sum(len(v) for v in self.missing.values())} (layer, expert) parts missing")
        return (f"{self.num_experts} routed experts per layer, EP={self.ep} expert TP={self.expert_tp} "
                f"expert DP={self.expert_dp}, {len(self.tensors)} expert tensors: {what}")


#: The sequential experts' (SequentialMLP's, and Transformer Engine's TEGroupedMLP's) fc1 weight
SEQUENTIAL_SUFFIX = "mlp.experts.experts.linear_fc1.weight"
#: Each kind as an error names it: megatron-core's module and the flag
KINDS = MappingProxyType({"grouped": "grouped-GEMM experts (megatron-core's GroupedMLP, --moe-grouped-gemm)",
                          "sequential": "sequential experts (megatron-core's SequentialMLP, without --moe-grouped-gemm)"})


def expert_kind(keys: Any) -> str | None:
    """``grouped`` or ``sequential`` from the model tensors' keys (None: no routed experts, or both kinds)."""
    kinds = {("grouped" if k.endswith(GROUPED_SUFFIXES["weight1"]) else "sequential") for k in keys
             if k.endswith((GROUPED_SUFFIXES["weight1"], SEQUENTIAL_SUFFIX))}
    return kinds.pop() if len(kinds) == 1 else None


def check_expert_kind(where: str, saved_keys: Any, job_kind: str | None) -> None:
    """Refuse (naming both kinds and the flag) a checkpoint whose routed experts are of the other kind than the
    job's: GroupedMLP's tensors are its parameters' memory order, SequentialMLP's another, and re-sharding does not
    transpose between them."""
    saved = expert_kind(saved_keys)
    if saved is None or job_kind is None or saved == job_kind:
        return
    flag = "without --moe-grouped-gemm" if saved == "sequential" else "with --moe-grouped-gemm"
    raise PlanError(f"{where}: the checkpoint holds {KINDS[saved]}, the job builds {KINDS[job_kind]}; tenplex does "
                    f"not re-shard between the two kinds (their weights are stored transposed from each other): "
                    f"restart {flag}")


def is_expert_key(key: str, param: str | None = None) -> bool:
    """Whether a tensor (or the optimizer state of ``param``) is a routed expert's."""
    return EXPERTS in (param or key)


def missing_experts(ptc: PTC) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per routed-expert tensor, the (layer, expert) pairs whose elements are not all stored. Overlaps are the
    partition check's (``planner.partition_errors``); this names which experts a save left out."""
    per: dict[str, dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
    for sc in ptc.chunks:
        t = ptc.tensors.get(sc.chunk.key)
        if t is None or not is_expert_key(t.key, t.param) or len(t.global_shape) < 3:
            continue
        c = sc.chunk
        (l0, e0), (nl, ne) = c.offsets[:2], c.shape[:2]
        # the box is (layer, expert) slabs end to end in row-major order; a flat range covers part of some of them
        slab = math.prod(c.shape) // (nl * ne) if nl * ne else 0
        if not slab:
            continue
        lo, hi = c.flat if c.flat is not None else (0, slab * nl * ne)
        for j in range(lo // slab, -(-hi // slab)):
            got = min(hi, (j + 1) * slab) - max(lo, j * slab)
            if got > 0:
                per[t.key][(l0 + j // ne, e0 + j % ne)] += got
    out = {}
    for key, t in ptc.tensors.items():
        if not is_expert_key(key, t.param) or len(t.global_shape) < 3:
            continue
        want = math.prod(t.global_shape[2:])
        got = per.get(key, {})
        out[key] = tuple((layer, e) for layer in range(t.global_shape[0]) for e in range(t.global_shape[1])
                         if got.get((layer, e), 0) < want)
    return out


def expert_summary(ptc: PTC, layout: dict[str, Any] | None) -> ExpertSummary | None:
    """The experts of a checkpoint (None for a dense model): counted from its routed-expert tensors' shapes."""
    tensors = tuple(sorted(k for k, t in ptc.tensors.items() if is_expert_key(k, t.param) and len(t.global_shape) >= 3))
    if not tensors:
        return None
    try:
        lay = ParallelLayout.from_json(layout or {"tp": 1, "pp": 1, "dp": 1})
    except (KeyError, TypeError, ValueError, LayoutError):
        lay = ParallelLayout()
    return ExpertSummary(num_experts=ptc.tensors[tensors[0]].global_shape[1], ep=lay.ep, expert_tp=lay.expert_tp,
                         expert_dp=lay.expert_dp, tensors=tensors, missing=missing_experts(ptc))
