"""``--tenplex-layout auto | measure | FILE.json`` for any trainer: the request, the choice, what to time. Pure Python.

A trainer (``training/layout_choice.py``, the Megatron-LM hook) turns its flags into a :class:`LayoutRequest`
for the world size torchrun gave it; :func:`choose` answers with the layout and micro-batch size: a user's
table row, or the top of the ranking (``plan/autolayout.py``) where measured iteration times (``measure``)
rank ahead of modelled ones. Explicitly given TP, PP, EP, expert TP or micro-batch size fix that degree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from tenplex_megatron.plan.autolayout import (
    DEFAULT_MICRO_BATCH_SIZES,
    LayoutCandidate,
    LayoutChoice,
    choose_layout,
    describe_refused,
)
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.layout_files import load_layout_table
from tenplex_megatron.plan.pipeline_split import SplitError, SplitRule
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims

RANKED_SPECS = ("auto", "measure")
#: ``measure`` at a new world size: the candidates timed, and the iterations each (untimed warm-up, then timed).
MEASURE_TRIALS = 3
MEASURE_WARMUP, MEASURE_TIMED = 1, 3


@dataclass(frozen=True)
class LayoutRequest:
    """What to choose for: ``spec`` (auto, measure or a table's path), the model, the world and what is fixed."""

    spec: str
    dims: GPTDims
    world_size: int
    gpus_per_node: int
    global_batch_size: int
    memory_gb: float | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch_size: int | None = None
    distributed_optimizer: bool = False
    ep: int | None = None  # a mixture of experts' EP, when given (else chosen among the EPs dividing the experts)
    vpp: int | None = None  # virtual pipeline stages per rank, when given (else chosen: 1 or an interleaving)
    make_vocab_size_divisible_by: int = 128
    expert_tp: int | None = None  # a mixture of experts' expert TP, when given (else chosen, TP's or another)
    sequence_parallel: bool = True  # --sequence-parallel: without it a mixture of experts stays at TP 1
    split: SplitRule = SplitRule()  # an uneven pipeline's flags: only a PP x VPP they fit is chosen
    #: the other global batch sizes still to come (a batch ramp or step schedule): only a micro-batch x DP dividing
    #: each of them is chosen
    batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Chosen:
    """The layout and micro-batch size to run, and one line for the log saying why."""

    layout: ParallelLayout
    micro_batch_size: int
    why: str


def rank(req: LayoutRequest, measured: Mapping[str, float] | None = None) -> LayoutChoice:
    """The ranked candidates for ``req`` (``measured``: seconds per iteration by candidate key at this world size).

    :class:`LayoutError` listing every refused candidate when none is usable."""
    fixed = {k: v for k, v in (("tp", req.tp), ("pp", req.pp), ("ep", req.ep), ("vpp", req.vpp),
                               ("expert_tp", req.expert_tp)) if v is not None}
    mbs = (req.micro_batch_size,) if req.micro_batch_size is not None else DEFAULT_MICRO_BATCH_SIZES
    return _keep_fitting(req, choose_layout(req.dims, req.world_size, req.gpus_per_node, req.global_batch_size,
                         memory_gb=req.memory_gb, micro_batch_sizes=mbs, fixed=fixed or None, measured=measured,
                         distributed_optimizer=req.distributed_optimizer,
                         make_vocab_size_divisible_by=req.make_vocab_size_divisible_by,
                         sequence_parallel=req.sequence_parallel))


def split_problem(req: LayoutRequest, layout: ParallelLayout) -> str | None:
    """Why the request's uneven-split flags do not fit ``layout``'s PP x VPP (None: they fit, or none given)."""
    if not req.split.given:
        return None
    try:
        req.split.counts(req.dims.num_layers, layout.pp, layout.vpp)
    except SplitError as e:
        return str(e)
    return None


def batch_problem(req: LayoutRequest, layout: ParallelLayout, micro_batch_size: int) -> str | None:
    """Which batch size still to come (a ramp or step schedule) micro-batch x DP does not divide (None: all)."""
    unit = micro_batch_size * layout.dp
    bad = [b for b in req.batch_sizes if b % unit]
    return f"the global batch of {bad[0]} still to come is not divisible by micro-batch x DP = " \
           f"{micro_batch_size} x {layout.dp}" if bad else None


def _keep_fitting(req: LayoutRequest, choice: LayoutChoice) -> LayoutChoice:
    """The ranking with every candidate the uneven split or a batch size still to come does not fit refused, saying
    why (the throughput and memory model splits the layers evenly and knows the final batch only);
    :class:`LayoutError` listing them all when none is left."""
    if not req.split.given and not req.batch_sizes:
        return choice
    ranking = []
    for c in choice.ranking:
        why = (split_problem(req, c.layout) or batch_problem(req, c.layout, c.micro_batch_size)) if c.usable else None
        ranking.append(replace(c, legal=False, reasons=(*c.reasons, why)) if why else c)
    ranking.sort(key=lambda c: not c.usable)  # stable: the order among the usable and among the refused stays
    if not ranking[0].usable:
        fits = " and ".join(x for x in (req.split.flags() if req.split.given else "",
                                        "the batch sizes still to come" if req.batch_sizes else "") if x)
        raise LayoutError(f"no usable layout for world size {req.world_size} that fits {fits}; every "
                          "candidate is refused:\n" + "\n".join(describe_refused(ranking)))
    return LayoutChoice(choice.world_size, ranking[0], tuple(ranking))


def describe_layout(layout: ParallelLayout, micro_batch_size: int, moe: bool) -> str:
    """How a trainer names a chosen layout: ``tp=2,pp=1,dp=4,sp,ep=4,etp=1, micro-batch 2``, for a mixture of experts
    with its expert layout spelled out (``expert TP 1 x EP 4 x expert DP 2``: the layout's string omits expert TP
    when it equals TP)."""
    text = f"{layout}, micro-batch {micro_batch_size}"
    if moe:
        text += f", expert TP {layout.expert_tp} x EP {layout.ep} x expert DP {layout.expert_dp}"
    return text


def to_measure(choice: LayoutChoice, measured: Mapping[str, float], top: int) -> tuple[LayoutCandidate, ...]:
    """The best ``top`` usable candidates by the model that have no measured time yet (``measure`` times these)."""
    modelled = sorted((c for c in choice.usable), key=lambda c: c.modelled.total if c.modelled else 0.0)
    return tuple(c for c in modelled[:top] if c.key not in measured)


def choose(req: LayoutRequest, measured: Mapping[str, float] | None = None) -> Chosen:
    """The layout for ``req``: its table's row, or the top of the ranking; :class:`LayoutError` if none."""
    if req.spec not in RANKED_SPECS:
        row = load_layout_table(req.spec, req.dims, gpus_per_node=req.gpus_per_node,
                                global_batch_size=req.global_batch_size).row(req.world_size)
        if why := split_problem(req, row.layout) or batch_problem(req, row.layout, row.micro_batch_size):
            raise LayoutError(f"{req.spec}: the row for world size {req.world_size} ({row.layout}): {why}")
        return Chosen(row.layout, row.micro_batch_size, f"from {req.spec}")
    choice = rank(req, measured)
    best = choice.best
    how = f"measured {best.measured_seconds:.3g}" if best.measured_seconds is not None else \
        f"modelled {best.seconds:.3g}"
    return Chosen(best.layout, best.micro_batch_size,
                  f"{req.spec}: best of {len(choice.usable)} usable of {len(choice.ranking)} candidates "
                  f"({how} s/iteration)")
