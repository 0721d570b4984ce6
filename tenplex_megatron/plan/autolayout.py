"""Choose TP, PP, DP (EP and expert TP for a mixture of experts) and the micro-batch size for a world size: legal,
fits memory, fastest. Pure Python.

Every (TP, PP, DP) with TP x PP x DP = world size is a candidate, for a mixture of experts with every EP that
divides the experts and every expert TP that divides the experts' FFN hidden size such that expert TP x EP x PP
divides the world size (megatron-core's ``initialize_model_parallel``: the experts' data-parallel size is what is
left, world / (expert TP x EP x PP); expert TP need not equal TP), and with every
micro-batch size offered; each is legal or refused with every reason, gets a
per-rank memory estimate and a modelled iteration time, and the candidates are
ranked: legal and fitting first, fastest first, a measured time (where one is
given for that candidate) ahead of any modelled one. The global batch is fixed
(VirtualFlow): DP x micro-batch x micro-batches = global batch.

The estimates are models, documented here, not measurements:

* Memory per rank (the busiest pipeline stage's): weights (2 bytes/param in
  bf16, 4 in fp32), gradients (4 bytes/param: Megatron-LM accumulates and
  reduces gradients in fp32 with bf16), optimizer state (fp32 main weights in
  bf16 plus two Adam moments: 12 or 8 bytes/param, divided over DP with the
  distributed optimizer) - with bf16 and the distributed optimizer this is
  Megatron's 6 + 12/DP bytes per parameter - and activations (Korthikanti et al., 16-bit activations, no
  recomputation, doubled for fp32) per layer, micro-batch and token: 10 x hidden bytes that sequence
  parallelism divides by TP and that stay whole on every TP rank without it (LayerNorm, attention and MLP inputs,
  dropout masks), plus, divided by TP, 8 x hidden + 5 x heads x seq for attention (the second term, the stored
  seq x seq scores, drops with ``flash_attention``: FlashAttention or selective recomputation) and 2 x (FC1's
  width + the FFN's) for the MLP (FC1 is twice the FFN with SwiGLU; a GELU MLP of 4 x hidden makes this
  Korthikanti's 34 x hidden + 5 x heads x seq). A mixture of experts' MLP stores instead, routing being balanced,
  the router's fp32 logits and probabilities (8 x experts bytes) and for each of the top-k copies of a token the
  experts' input (2 x hidden, gathered over expert TP: times expert TP), their FC1 output and activation (each cut
  by expert TP) and their output weighted at the combine (2 x hidden), and the shared experts' MLP; all that
  divided by TP too (each rank routes 1/TP of the tokens under sequence parallelism). That times the layers on
  the stage, times the micro-batches the 1F1B
  schedule keeps in flight on stage s: min(PP - s, micro-batches); an interleaved pipeline (VPP virtual stages
  per rank) keeps 1 + (PP - 1) / (PP x VPP) times that. A routed expert's parameters (weights, gradients) are
  divided over expert TP x EP instead of TP, and its optimizer state over expert DP (world / (expert TP x EP x
  PP)). Logits,
  temporary buffers, the CUDA context and allocator fragmentation are left out:
  give the budget less than the device's memory to leave room for them.
* Iteration time: compute 6 x params x tokens / (world x FLOP/s per GPU) (for a mixture of experts the active
  parameters: the dense ones and top-k of the experts); the
  pipeline bubble adds compute x (PP - 1) / (micro-batches x VPP) (an interleaved pipeline's smaller bubble, for
  VPP times the stage-to-stage sends and pipeline slots); TP costs ring
  all-reduces of one micro-batch's activations per layer and micro-batch, two for attention and two for a dense
  MLP (or a mixture of experts' shared experts), forward and backward
  (2 (TP - 1) / TP of the bytes over the intra-node link: it grows with the TP
  degree); a mixture of experts' routed experts replace the dense MLP's two (megatron-core's alltoall
  dispatcher): each rank routes its 1/TP of a micro-batch's tokens (sequence parallelism, which megatron-core
  needs with MoE at TP > 1), top-k copies of them, R bytes; EP sends them to the other EP ranks and back,
  forward and backward (4 x R x (EP - 1) / EP, over the intra-node link when expert TP x EP fits a node), and
  expert TP all-gathers them over the expert TP group before the experts and reduce-scatters the experts'
  output after, forward and backward (4 x R x (expert TP - 1): expert TP cuts each expert's FFN, so every rank
  of the group needs every routed token; the group lies within a node). So for the same experts per rank, EP
  costs (EP - 1) / EP of R where expert TP costs (expert TP - 1) R: at a TP that attention needs, the experts
  are cheaper whole (expert TP 1) and spread over EP, unless too few experts leave only expert TP to divide
  their memory. PP sends activations and their gradients between stages (intra-node
  link when the job fits on one node, the inter-node link otherwise); DP reduces
  the gradients of the busiest stage (a ring all-reduce, or with the distributed
  optimizer a reduce-scatter of gradients plus an all-gather of parameters; the experts' over expert DP),
  over the intra-node link when every DP group lies within a node; and each of
  the (micro-batches + PP - 1) pipeline slots costs a fixed overhead (kernel
  launches, scheduling). Nothing is assumed to overlap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.layout import LayoutError, ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors, is_expert

GIB = 1 << 30
#: Micro-batch sizes tried when the caller offers none.
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Hardware:
    """The throughput model's machine: achieved FLOP/s per GPU, link bandwidths (bytes/s), per-slot overhead (s).

    The defaults are an A100-class GPU at about half its 312 TFLOP/s bf16 peak,
    NVLink within a node and a 100 Gb/s network between nodes.
    """

    flops_per_gpu: float = 150e12
    intra_node_bandwidth: float = 100e9
    inter_node_bandwidth: float = 12.5e9
    slot_overhead_s: float = 1e-3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank of the busiest pipeline stage (``stage``), by kind."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    stage: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class TimeEstimate:
    """A modelled iteration's seconds, by cause (see the module's docstring)."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    overhead: float
    ep_comm: float = 0.0
    etp_comm: float = 0.0  # expert TP's all-gathers and reduce-scatters of the routed tokens

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.overhead + self.ep_comm
                + self.etp_comm)


@dataclass(frozen=True)
class LayoutCandidate:
    """One (TP, PP, DP, micro-batch size) for a world size: legal or why not, fits or not, its estimates.

    ``reasons`` says why the candidate is refused (empty when usable): broken
    legality rules, or the memory estimate over the budget. Estimates are None
    for an illegal candidate.
    """

    layout: ParallelLayout
    micro_batch_size: int
    legal: bool
    fits: bool
    reasons: tuple[str, ...]
    num_microbatches: int | None = None
    memory: MemoryEstimate | None = None
    modelled: TimeEstimate | None = None
    measured_seconds: float | None = None

    @property
    def usable(self) -> bool:
        return self.legal and self.fits

    @property
    def key(self) -> str:
        """``tp=2,pp=1,dp=2,mbs=4``: how measured-time files and messages name the candidate."""
        return candidate_key(self.layout, self.micro_batch_size)

    @property
    def seconds(self) -> float | None:
        """The measured iteration time where there is one, else the modelled one."""
        if self.measured_seconds is not None:
            return self.measured_seconds
        return self.modelled.total if self.modelled is not None else None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: degrees, verdict, reasons, estimates (bytes and seconds)."""
        d: dict[str, Any] = {"key": self.key, **self.layout.to_json(), "micro_batch_size": self.micro_batch_size,
                             "usable": self.usable, "legal": self.legal, "fits": self.fits,
                             "reasons": list(self.reasons), "num_microbatches": self.num_microbatches,
                             "seconds": self.seconds, "measured_seconds": self.measured_seconds}
        if self.memory is not None:
            d["memory"] = {**asdict(self.memory), "total": self.memory.total}
        if self.modelled is not None:
            d["modelled"] = {**asdict(self.modelled), "total": self.modelled.total}
        return d


@dataclass(frozen=True)
class LayoutChoice:
    """The chosen candidate and the whole ranking it tops (refused candidates last, with their reasons)."""

    world_size: int
    best: LayoutCandidate
    ranking: tuple[LayoutCandidate, ...] = field(repr=False)

    @property
    def usable(self) -> tuple[LayoutCandidate, ...]:
        """The usable candidates, best first (``usable[:3]``: the few worth timing)."""
        return tuple(c for c in self.ranking if c.usable)

    @property
    def refused(self) -> tuple[LayoutCandidate, ...]:
        return tuple(c for c in self.ranking if not c.usable)


def candidate_key(layout: ParallelLayout, micro_batch_size: int) -> str:
    return f"{layout},mbs={micro_batch_size}"


def parse_candidate_key(text: str) -> tuple[ParallelLayout, int]:
    """Inverse of :func:`candidate_key`: ``tp=2,pp=1,dp=2,mbs=4`` -> (layout, 4)."""
    head, sep, mbs = text.rpartition(",mbs=")
    try:
        value = int(mbs)
    except ValueError:
        value = 0
    if not sep or value < 1:
        raise LayoutError(f"cannot parse {text!r}: expected e.g. tp=2,pp=1,dp=2,mbs=4")
    return ParallelLayout.parse(head), value


def illegal_reasons(dims: GPTDims, layout: ParallelLayout, micro_batch_size: int, global_batch_size: int | None,
                    *, world_size: int | None = None, gpus_per_node: int | None = None,
                    sequence_parallel: bool = True) -> list[str]:
    """Every rule the candidate breaks (empty: legal). World size, GPUs per node, global batch: checked when given.
    ``sequence_parallel``: whether the job runs with ``--sequence-parallel`` (megatron-core trains a mixture of
    experts at TP > 1 only with it)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    out = []
    if gpus_per_node is not None and tp > gpus_per_node:
        out.append(f"TP={tp} spans more than the {gpus_per_node} GPUs of a node")
    for what, size in (("attention heads", dims.num_attention_heads), ("query groups", dims.query_groups),
                       ("hidden size", dims.hidden_size), ("FFN hidden size", dims.ffn)):
        if what == "query groups" and dims.num_query_groups is None:
            continue
        if size % tp:
            out.append(f"TP={tp} does not divide the {what} ({size})")
    if dims.num_layers % pp:
        out.append(f"PP={pp} does not divide the {dims.num_layers} layers")
    elif layout.vpp > 1 and dims.num_layers % (pp * layout.vpp):
        out.append(f"PP x VPP = {pp} x {layout.vpp} does not divide the {dims.num_layers} layers")
    if dims.num_experts:
        out.extend(_expert_reasons(dims, layout, gpus_per_node, sequence_parallel))
    elif layout.ep > 1 or layout.etp:
        out.append(f"EP={layout.ep} / expert TP={layout.expert_tp} need a mixture-of-experts model")
    if world_size is not None and layout.world_size != world_size:
        out.append(f"TP x PP x DP = {tp} x {pp} x {dp} = {layout.world_size} is not the world size {world_size}")
    if micro_batch_size < 1:
        out.append(f"micro-batch size {micro_batch_size} is not positive")
    elif global_batch_size is None:
        pass
    elif global_batch_size % dp:
        out.append(f"DP={dp} does not divide the global batch size {global_batch_size}")
    elif global_batch_size % (dp * micro_batch_size):
        out.append(f"DP x micro-batch = {dp} x {micro_batch_size} = {dp * micro_batch_size} does not divide "
                   f"the global batch size {global_batch_size}")
    elif layout.vpp > 1 and (global_batch_size // (dp * micro_batch_size)) % pp:
        out.append(f"VPP={layout.vpp}: megatron-core's interleaved schedule needs the "
                   f"{global_batch_size // (dp * micro_batch_size)} micro-batches to be a multiple of PP={pp}")
    return out


def _expert_reasons(dims: GPTDims, layout: ParallelLayout, gpus_per_node: int | None,
                    sequence_parallel: bool) -> list[str]:
    """The rules megatron-core 0.16 sets a mixture of experts' EP and expert TP (``initialize_model_parallel``,
    ``TransformerConfig``, ``MoELayer``)."""
    etp, out = layout.expert_tp, []
    if dims.num_experts and dims.num_experts % layout.ep:
        out.append(f"EP={layout.ep} does not divide the {dims.num_experts} experts")
    if dims.expert_ffn % etp:
        out.append(f"expert TP={etp} does not divide the experts' FFN hidden size ({dims.expert_ffn})")
    if gpus_per_node is not None and etp > gpus_per_node:
        out.append(f"expert TP={etp} spans more than the {gpus_per_node} GPUs of a node")
    if layout.tp > 1 and not sequence_parallel:
        out.append(f"TP={layout.tp} with a mixture of experts needs --sequence-parallel (megatron-core refuses to "
                   "train without it)")
    if dims.add_bias_linear and etp > 1:
        out.append(f"expert TP={etp} with linear biases: megatron-core adds experts' biases only at expert TP 1 "
                   "(give --disable-bias-linear)")
    elif dims.add_bias_linear and layout.ep == 1:
        out.append("EP=1 x expert TP=1 with linear biases: megatron-core's expert MLP fails there (give "
                   "--disable-bias-linear)")
    return out


def stage_parameters(dims: GPTDims, layout: ParallelLayout, make_vocab_size_divisible_by: int = 128,
                     experts: bool | None = None) -> list[int]:
    """Parameters held by one rank of each pipeline stage (the tied embedding counted on both ends); a routed
    expert's divided over expert TP x EP. ``experts`` True / False: only the routed experts' / only the others."""
    return list(_stage_parameters(dims, layout.tp, layout.pp, layout.ep, layout.expert_tp,
                                  make_vocab_size_divisible_by, experts))


@functools.lru_cache(maxsize=4096)
def _stage_parameters(dims: GPTDims, tp: int, pp: int, ep: int, etp: int, make_vocab_size_divisible_by: int,
                      experts: bool | None) -> tuple[int, ...]:
    """:func:`stage_parameters` by the degrees it depends on (the candidates of a ranking share them)."""
    padded = padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, tp)
    per = [0] * pp
    each = 0  # the transformer layers' parameters on every stage
    for numel, split, expert, stage, tied in _parameter_rows(dims, padded):
        if experts is not None and expert != experts:
            continue
        if expert:
            n = numel // ep // (etp if split else 1)
        else:
            n = numel // tp if split else numel
        if stage == "layers":
            each += n // pp
        elif stage == "last":
            per[-1] += n
        else:
            per[0] += n
            if tied and pp > 1:
                per[-1] += n
    return tuple(n + each for n in per)


@functools.lru_cache(maxsize=256)
def _parameter_rows(dims: GPTDims, padded_vocab: int) -> tuple[tuple[int, bool, bool, str, bool], ...]:
    """(elements, TP-split, a routed expert's, stage, tied) of every parameter: what the estimates need of the
    model's tensors, built once per model and padded vocabulary (a ranking evaluates thousands of candidates)."""
    return tuple((t.numel, t.tp_axis is not None, is_expert(t), t.stage, t.tied)
                 for t in gpt_tensors(dims, padded_vocab, optimizer=False).values())


def activation_bytes_per_layer(dims: GPTDims, micro_batch_size: int, tp: int, flash_attention: bool = False, *,
                               expert_tp: int = 1, sequence_parallel: bool = True) -> float:
    """One layer's stored activations for one micro-batch on one TP rank: Korthikanti et al.'s terms, the MLP's from
    its widths and a mixture of experts' from its routed token copies (the module's docstring has the model)."""
    s, h, a = dims.seq_length, dims.hidden_size, dims.num_attention_heads
    width = 1 if dims.bf16 else 2  # the terms count bytes of 16-bit activations
    whole = 10 * h  # LayerNorm inputs, attention and MLP inputs, two dropout masks: split by TP only with SP
    split = 8 * h + (0 if flash_attention else 5 * a * s)  # QK^T, the values' product, the projection's input
    if dims.num_experts:
        k, fe = dims.moe_router_topk, dims.expert_ffn
        # router logits and probabilities in fp32; each of top-k copies per token: the experts' input, gathered over
        # expert TP, their FC1 output and activation (each cut by expert TP) and the output weighted at the combine
        split += 8 * dims.num_experts / width + k * (2 * h * expert_tp + 2 * _fc1_width(dims, fe) + 2 * fe + 2 * h)
        shared = dims.moe_shared_expert_intermediate_size
        if shared:
            split += 2 * _fc1_width(dims, shared) + 2 * shared
    else:
        split += 2 * _fc1_width(dims, dims.ffn) + 2 * dims.ffn  # FC1's output and the activation's
    per_token = whole / (tp if sequence_parallel else 1) + split / tp
    return s * micro_batch_size * per_token * width


def _fc1_width(dims: GPTDims, ffn: int) -> int:
    """FC1's output width: the FFN's, twice it for a gated (SwiGLU) MLP."""
    return 2 * ffn if dims.swiglu else ffn


def estimate_memory(dims: GPTDims, layout: ParallelLayout, micro_batch_size: int, global_batch_size: int, *,
                    distributed_optimizer: bool = True, make_vocab_size_divisible_by: int = 128,
                    flash_attention: bool = False, sequence_parallel: bool = True) -> MemoryEstimate:
    """Per-rank bytes of the busiest pipeline stage for a legal candidate (the module's docstring has the model)."""
    m = global_batch_size // (layout.dp * micro_batch_size)
    weight_b = 2 if dims.bf16 else 4
    optim_b = 12 if dims.bf16 else 8
    per_layer = activation_bytes_per_layer(dims, micro_batch_size, layout.tp, flash_attention,
                                           expert_tp=layout.expert_tp, sequence_parallel=sequence_parallel)
    layers = dims.num_layers // layout.pp
    interleave = 1 + (layout.pp - 1) / (layout.pp * layout.vpp) if layout.vpp > 1 else 1.0
    expert = stage_parameters(dims, layout, make_vocab_size_divisible_by, experts=True)
    expert_dp = layout.expert_dp
    best: tuple[int, int, int, int, int] | None = None  # (total, weights, optimizer, activations, stage)
    for s, n in enumerate(stage_parameters(dims, layout, make_vocab_size_divisible_by)):
        dense_optim, expert_optim = optim_b * (n - expert[s]), optim_b * expert[s]
        optim = (math.ceil(dense_optim / layout.dp) + math.ceil(expert_optim / expert_dp)
                 if distributed_optimizer else dense_optim + expert_optim)
        act = math.ceil(per_layer * layers * min(layout.pp - s, m) * interleave)
        total = weight_b * n + 4 * n + optim + act
        if best is None or total > best[0]:  # the first stage of the busiest
            best = (total, n, optim, act, s)
    assert best is not None
    _, n, optim, act, stage = best
    return MemoryEstimate(weights=weight_b * n, gradients=4 * n, optimizer=optim, activations=act, stage=stage)


def total_parameters(dims: GPTDims, make_vocab_size_divisible_by: int = 128) -> int:
    """The model's parameters (the tied embedding once, vocabulary padded as at TP 1)."""
    padded = padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, 1)
    return sum(t.numel for t in gpt_tensors(dims, padded, optimizer=False).values())


def active_parameters(dims: GPTDims, make_vocab_size_divisible_by: int = 128) -> int:
    """The parameters one token goes through: all of a dense model's; a mixture of experts' dense ones and top-k of
    its routed experts."""
    padded = padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, 1)
    total = 0
    for numel, _, expert, _, _ in _parameter_rows(dims, padded):
        total += numel * dims.moe_router_topk // int(dims.num_experts or 1) if expert else numel
    return total


def estimate_time(dims: GPTDims, layout: ParallelLayout, micro_batch_size: int, global_batch_size: int,
                  gpus_per_node: int, *, hardware: Hardware = Hardware(), distributed_optimizer: bool = True,
                  make_vocab_size_divisible_by: int = 128) -> TimeEstimate:
    """Modelled seconds per iteration of a legal candidate (the module's docstring has the model)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    world = layout.world_size
    m = global_batch_size // (dp * micro_batch_size)
    tokens = global_batch_size * dims.seq_length
    compute = 6 * active_parameters(dims, make_vocab_size_divisible_by) * tokens / (world * hardware.flops_per_gpu)
    vpp = layout.vpp
    bubble = compute * (pp - 1) / (m * vpp)
    act_width = 2 if dims.bf16 else 4
    act = dims.seq_length * micro_batch_size * dims.hidden_size * act_width  # one micro-batch's hidden states
    layers = dims.num_layers // pp
    # attention's two all-reduces, and a dense MLP's (or shared experts') two: a routed MLP's go to EP / expert TP
    all_reduces = 4 if not dims.num_experts or dims.moe_shared_expert_intermediate_size else 2
    tp_comm = m * layers * all_reduces * 2 * (tp - 1) / tp * act / hardware.intra_node_bandwidth
    one_node = world <= gpus_per_node
    pp_bw = hardware.intra_node_bandwidth if one_node else hardware.inter_node_bandwidth
    pp_comm = 2 * m * vpp * act / pp_bw if pp > 1 else 0.0
    # a DP group is tp apart within a block of tp x dp consecutive ranks (megatron-core's tp-dp-pp order)
    dp_bw = hardware.intra_node_bandwidth if one_node or gpus_per_node % (tp * dp) == 0 else hardware.inter_node_bandwidth
    stages = stage_parameters(dims, layout, make_vocab_size_divisible_by)
    expert = stage_parameters(dims, layout, make_vocab_size_divisible_by, experts=True)
    busiest = max(range(pp), key=lambda s: stages[s])
    weight_b = 2 if dims.bf16 else 4

    def reduce_bytes(params: int, group: int) -> float:
        share = (group - 1) / group
        return share * params * (4 + weight_b) if distributed_optimizer else 2 * share * params * 4

    dp_bytes = reduce_bytes(stages[busiest] - expert[busiest], dp) + reduce_bytes(expert[busiest], layout.expert_dp)
    ep_comm = etp_comm = 0.0
    if dims.num_experts:
        etp, ep = layout.expert_tp, layout.ep
        routed = dims.moe_router_topk * act / tp  # this rank's share of the sequence (SP), top-k copies
        ep_bw = hardware.intra_node_bandwidth if etp * ep <= gpus_per_node else hardware.inter_node_bandwidth
        ep_comm = m * layers * 4 * routed * (ep - 1) / ep / ep_bw
        etp_comm = m * layers * 4 * routed * (etp - 1) / hardware.intra_node_bandwidth
    return TimeEstimate(compute=compute, bubble=bubble, tp_comm=tp_comm, pp_comm=pp_comm,
                        dp_comm=dp_bytes / dp_bw, overhead=(m * vpp + pp - 1) * hardware.slot_overhead_s,
                        ep_comm=ep_comm, etp_comm=etp_comm)


def _virtual_stages(pp: int, num_layers: int | None) -> Iterable[int]:
    """1, and at PP > 1 every interleaving (VPP) that splits each rank's layers into equal model chunks."""
    yield 1
    if pp > 1 and num_layers and num_layers % pp == 0:
        yield from (v for v in range(2, num_layers // pp + 1) if (num_layers // pp) % v == 0)


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _factorizations(world_size: int, num_experts: int | None = None, num_layers: int | None = None,
                    expert_ffn: int | None = None) -> Iterable[ParallelLayout]:
    """Every TP x PP x DP = world size, with every VPP that divides a rank's ``num_layers`` (when given); for a
    mixture of experts each with every EP dividing the experts and every expert TP dividing the experts' FFN
    hidden size (``expert_ffn``) for which expert TP x EP x PP divides the world size (megatron-core's rule)."""
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            experts = [(ep, etp) for ep in _divisors(num_experts) if (world_size // pp) % ep == 0
                       for etp in _divisors(world_size // (pp * ep)) if expert_ffn and expert_ffn % etp == 0] \
                if num_experts else [(1, tp)]
            for ep, etp in experts:
                for vpp in _virtual_stages(pp, num_layers):
                    yield ParallelLayout(tp, pp, dp, vpp=vpp, ep=ep, etp=etp)


def _check_inputs(world_size: int, gpus_per_node: int, global_batch_size: int, memory_gb: float | None,
                  micro_batch_sizes: Sequence[int]) -> None:
    for name, value in (("world size", world_size), ("GPUs per node", gpus_per_node),
                        ("global batch size", global_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    if memory_gb is not None and not memory_gb > 0:
        raise LayoutError(f"memory budget must be positive (GiB), got {memory_gb!r}")
    if not micro_batch_sizes or any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in micro_batch_sizes):
        raise LayoutError(f"micro-batch sizes must be positive integers, got {list(micro_batch_sizes)!r}")


def evaluate(dims: GPTDims, layout: ParallelLayout, micro_batch_size: int, global_batch_size: int, *,
             world_size: int | None = None, gpus_per_node: int | None = None, memory_gb: float | None = None,
             measured_seconds: float | None = None, fixed: Mapping[str, int] | None = None,
             hardware: Hardware = Hardware(), distributed_optimizer: bool = True,
             make_vocab_size_divisible_by: int = 128, flash_attention: bool = False,
             sequence_parallel: bool = True) -> LayoutCandidate:
    """One candidate: its legality (and ``fixed`` degrees, e.g. ``{"tp": 2}``), memory, fit and modelled time."""
    reasons = illegal_reasons(dims, layout, micro_batch_size, global_batch_size, world_size=world_size,
                              gpus_per_node=gpus_per_node, sequence_parallel=sequence_parallel)
    for name, value in (fixed or {}).items():
        got = micro_batch_size if name == "micro_batch_size" else getattr(layout, name)
        if got != value:
            reasons.append(f"{_FIXED_NAMES.get(name, name.upper())} is fixed at {value}")
    if reasons:
        return LayoutCandidate(layout, micro_batch_size, legal=False, fits=False, reasons=tuple(reasons),
                               measured_seconds=measured_seconds)
    kw = {"distributed_optimizer": distributed_optimizer, "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    memory = estimate_memory(dims, layout, micro_batch_size, global_batch_size, flash_attention=flash_attention,
                             sequence_parallel=sequence_parallel, **kw)
    modelled = estimate_time(dims, layout, micro_batch_size, global_batch_size, gpus_per_node or layout.world_size,
                             hardware=hardware, **kw)
    fits = memory_gb is None or memory.total <= memory_gb * GIB
    if not fits:
        assert memory_gb is not None
        reasons.append(f"needs {memory.total / GIB:.2f} GiB per rank (stage {memory.stage}), "
                       f"over the budget of {memory_gb:g} GiB")
    return LayoutCandidate(layout, micro_batch_size, legal=True, fits=fits, reasons=tuple(reasons),
                           num_microbatches=global_batch_size // (layout.dp * micro_batch_size),
                           memory=memory, modelled=modelled, measured_seconds=measured_seconds)


_FIXED_NAMES = MappingProxyType({"micro_batch_size": "micro-batch size", "expert_tp": "expert TP"})


def _rank_key(c: LayoutCandidate) -> tuple:
    if c.usable:  # measured first (a fact about this machine, in other units than the model), then fastest
        group, score = (0 if c.measured_seconds is not None else 1), c.seconds
    elif c.legal:
        group, score = 2, float(c.memory.total if c.memory else 0)
    else:
        group, score = 3, 0.0
    return group, score, c.layout.tp, c.layout.pp, c.layout.vpp, c.layout.ep, c.layout.expert_tp, c.micro_batch_size


def rank_layouts(dims: GPTDims, world_size: int, gpus_per_node: int, global_batch_size: int, *,
                 memory_gb: float | None = None, micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
                 measured: Mapping[str, float] | None = None, fixed: Mapping[str, int] | None = None,
                 hardware: Hardware = Hardware(), distributed_optimizer: bool = True,
                 make_vocab_size_divisible_by: int = 128, flash_attention: bool = False,
                 sequence_parallel: bool = True) -> tuple[LayoutCandidate, ...]:
    """Every candidate for ``world_size``, ranked: usable ones first, measured then modelled, fastest first.

    ``measured`` maps candidate keys (``tp=2,pp=1,dp=2,mbs=4``) to seconds per
    iteration at this world size; ``memory_gb`` (GiB per rank) None means no
    limit; ``fixed`` pins degrees the user set (keys ``tp``, ``pp``, ``dp``, ``vpp``, ``ep``, ``expert_tp``,
    ``micro_batch_size``): other candidates are refused saying so. ``flash_attention``:
    no stored attention scores (FlashAttention or selective recomputation). ``sequence_parallel``: the job runs
    with ``--sequence-parallel`` (without it a mixture of experts is refused at TP > 1, as megatron-core does).
    """
    _check_inputs(world_size, gpus_per_node, global_batch_size, memory_gb, micro_batch_sizes)
    unknown = set(fixed or {}) - {"tp", "pp", "dp", "vpp", "ep", "expert_tp", "micro_batch_size"}
    if unknown:
        raise LayoutError(f"cannot fix {sorted(unknown)}: only tp, pp, dp, vpp, ep, expert_tp and micro_batch_size")
    measured = dict(measured or {})
    out = []
    for layout in _factorizations(world_size, dims.num_experts, dims.num_layers, dims.expert_ffn):
        for mbs in sorted(set(micro_batch_sizes)):
            key = candidate_key(layout, mbs)
            out.append(evaluate(dims, layout, mbs, global_batch_size, world_size=world_size,
                                gpus_per_node=gpus_per_node, memory_gb=memory_gb, measured_seconds=measured.get(key),
                                fixed=fixed, hardware=hardware, distributed_optimizer=distributed_optimizer,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                flash_attention=flash_attention, sequence_parallel=sequence_parallel))
    return tuple(sorted(out, key=_rank_key))


def choose_layout(dims: GPTDims, world_size: int, gpus_per_node: int, global_batch_size: int, *,
                  memory_gb: float | None = None, micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
                  measured: Mapping[str, float] | None = None, fixed: Mapping[str, int] | None = None,
                  hardware: Hardware = Hardware(), distributed_optimizer: bool = True,
                  make_vocab_size_divisible_by: int = 128, flash_attention: bool = False,
                  sequence_parallel: bool = True) -> LayoutChoice:
    """The top of :func:`rank_layouts`; :class:`LayoutError` listing every refused candidate when none is usable."""
    ranking = rank_layouts(dims, world_size, gpus_per_node, global_batch_size, memory_gb=memory_gb,
                           micro_batch_sizes=micro_batch_sizes, measured=measured, fixed=fixed, hardware=hardware,
                           distributed_optimizer=distributed_optimizer,
                           make_vocab_size_divisible_by=make_vocab_size_divisible_by, flash_attention=flash_attention,
                           sequence_parallel=sequence_parallel)
    if not ranking[0].usable:
        budget = f"{memory_gb:g} GiB per rank" if memory_gb is not None else "no memory limit"
        raise LayoutError(
            f"no usable layout for world size {world_size} ({gpus_per_node} GPUs per node, global batch size "
            f"{global_batch_size}, {budget}); every candidate is refused:\n" + "\n".join(describe_refused(ranking)))
    return LayoutChoice(world_size, ranking[0], ranking)


def describe_refused(candidates: Iterable[LayoutCandidate]) -> list[str]:
    """One line per refused layout and reason set: ``tp=5,pp=1,dp=1 mbs=1,2,4,8: reason; reason``."""
    groups: dict[tuple[ParallelLayout, tuple[str, ...]], list[int]] = {}
    for c in candidates:
        if not c.usable:
            groups.setdefault((c.layout, c.reasons), []).append(c.micro_batch_size)
    return [f"  {layout} mbs={','.join(map(str, sorted(mbs)))}: {'; '.join(reasons)}"
            for (layout, reasons), mbs in groups.items()]
