"""``python -m tenplex_megatron layouts``: every TP/PP/DP/micro-batch for a GPU count ranked by modelled (or
measured) time, with its memory and why each excluded one is excluded. Never imports torch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tenplex_megatron.cli_common import CLIError
from tenplex_megatron.cli_options import add_job_options, distributed_optimizer, gpus_per_node
from tenplex_megatron.plan.autolayout import (
    GIB,
    Hardware,
    LayoutCandidate,
    describe_refused,
    rank_layouts,
    total_parameters,
)
from tenplex_megatron.plan.layout import LayoutError
from tenplex_megatron.plan.layout_files import read_layout_times
from tenplex_megatron.plan.sim.gpt_catalogue import load_model


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None


def cmd_layouts(args: argparse.Namespace) -> int:
    """Every (TP, PP, DP, micro-batch) for --gpus, ranked, with estimates; each excluded one with its reasons."""
    try:
        dims = load_model(args.model)
    except KeyError as e:
        raise CLIError(str(e).strip("'\"")) from None
    args.gpus_per_node, args.distributed_optimizer = gpus_per_node(args), distributed_optimizer(args)
    hardware = Hardware(flops_per_gpu=args.tflops_per_gpu * 1e12)
    try:
        measured = read_layout_times(args.times).get(args.gpus, {}) if args.times else {}
        ranking = rank_layouts(dims, args.gpus, args.gpus_per_node, args.global_batch_size, memory_gb=args.memory_gb,
                               micro_batch_sizes=args.micro_batch_sizes, measured=measured, hardware=hardware,
                               distributed_optimizer=args.distributed_optimizer, flash_attention=args.flash_attention,
                               sequence_parallel=args.sequence_parallel)
    except LayoutError as e:
        raise CLIError(str(e)) from None
    usable = [c for c in ranking if c.usable]
    shown = usable[: args.top] if args.top else usable
    if args.json:
        print(json.dumps({
            "model": args.model, "parameters": total_parameters(dims), "world_size": args.gpus,
            "gpus_per_node": args.gpus_per_node, "global_batch_size": args.global_batch_size,
            "memory_gib": args.memory_gb, "distributed_optimizer": args.distributed_optimizer,
            "sequence_parallel": args.sequence_parallel,
            "flops_per_gpu": hardware.flops_per_gpu, "best": usable[0].key if usable else None,
            "candidates": [{**c.to_json(), **({"expert_tp": c.layout.expert_tp, "expert_dp": c.layout.expert_dp}
                                              if dims.num_experts else {})} for c in ranking],
        }, indent=1))
    else:
        _print_layouts(args, dims.bf16, total_parameters(dims), hardware, ranking, shown, bool(dims.num_experts))
    if not usable:
        raise CLIError(f"no usable layout for {args.gpus} GPUs: every candidate is refused (reasons above)")
    return 0


def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _print_layouts(args: argparse.Namespace, bf16: bool, params: int, hw: Hardware,
                   ranking: tuple[LayoutCandidate, ...], shown: list[LayoutCandidate], moe: bool = False) -> None:
    """The ranking as a table; for a mixture of experts with each candidate's expert TP x EP x expert DP (the key
    names expert TP only where it differs from TP) and the EP and expert TP communication."""
    budget = f"{args.memory_gb:g} GiB per rank" if args.memory_gb else "no memory limit"
    print(f"layouts      {args.model} ({_fmt_count(params)} parameters, {'bf16' if bf16 else 'fp32'}) on {args.gpus} "
          f"GPUs, {args.gpus_per_node} per node; global batch {args.global_batch_size}; {budget}; "
          f"distributed optimizer: {args.distributed_optimizer}; sequence parallelism: {args.sequence_parallel}")
    print(f"model        {hw.flops_per_gpu / 1e12:g} TFLOP/s per GPU, {hw.intra_node_bandwidth / 1e9:g} GB/s within a "
          f"node, {hw.inter_node_bandwidth / 1e9:g} GB/s between nodes (tenplex_megatron/plan/autolayout.py)")
    usable = sum(c.usable for c in ranking)
    print(f"candidates   {len(ranking)}: {usable} usable, {len(ranking) - usable} excluded")
    if moe:
        print("experts      ETPxEPxEDP: expert TP x EP x expert DP" + ("" if args.sequence_parallel else
              "; TP 1 only: megatron-core needs --sequence-parallel with MoE at TP > 1"))
    width, head = (38, f"{'ETPxEPxEDP':>12} ") if moe else (24, "")
    if shown:
        print(f"\n{'#':>3}  {'layout':<{width}} {head}{'micro-batches':>13}  "
              f"{'memory/rank':>11}  {'(weights+grads+optim+activ)':<27}  {'s/iter':>8}  "
              f"(bubble, TP, PP, DP{', EP, expert TP' if moe else ''} comm)")
    for i, c in enumerate(shown, 1):
        mem, t = c.memory, c.modelled
        assert mem is not None and t is not None
        parts = "+".join(f"{x / GIB:.1f}" for x in (mem.weights, mem.gradients, mem.optimizer, mem.activations))
        comm = ", ".join(f"{x:.2f}" for x in (t.bubble, t.tp_comm, t.pp_comm, t.dp_comm,
                                              *((t.ep_comm, t.etp_comm) if moe else ())))
        how = "measured" if c.measured_seconds is not None else "modelled"
        lay = c.layout
        experts = f"{f'{lay.expert_tp}x{lay.ep}x{lay.expert_dp}':>12} " if moe else ""
        print(f"{i:>3}  {c.key:<{width}} {experts}{c.num_microbatches:>13}  {mem.total / GIB:>7.2f} GiB  {parts:<27}  "
              f"{c.seconds:>8.3f}  ({comm}) {how}")
    if len(shown) < usable:
        print(f"     ... {usable - len(shown)} more usable (--top 0 shows all)")
    refused = describe_refused(ranking)
    if refused:
        print(f"\nexcluded ({len(ranking) - usable} candidates):")
        print("\n".join(refused))


def add_parser(sub: Any) -> None:
    """The ``layouts`` subcommand and its flags."""
    la = sub.add_parser("layouts", help="rank every TP/PP/DP/micro-batch for a GPU count: memory, modelled time, "
                                        "why a layout is excluded")
    la.add_argument("--gpus", type=int, required=True, help="world size: the number of GPUs (processes)")
    add_job_options(la, required=("model",))
    la.add_argument("--micro-batch-sizes", type=_int_list, default=[1, 2, 4, 8],
                    help="micro-batch sizes to try, comma-separated (default 1,2,4,8)")
    la.add_argument("--times", help="measured iteration times (JSON written by --tenplex-layout measure)")
    la.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="the job runs without --sequence-parallel: part of each layer's activations stays whole on "
                         "every TP rank, and a mixture of experts stays at TP 1")
    la.add_argument("--flash-attention", action="store_true",
                    help="no stored attention scores (FlashAttention or selective recomputation) in the memory estimate")
    la.add_argument("--top", type=int, default=0, help="print only the best N usable candidates (0: all)")
    la.add_argument("--json", action="store_true")
    la.set_defaults(fn=cmd_layouts)
