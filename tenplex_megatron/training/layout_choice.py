"""``--tenplex-layout auto | FILE.json``: the layout and micro-batch size for the world size torchrun gave us.

Runs on every start and every restart torchrun makes, before any process
group exists: the world size is ``WORLD_SIZE``, the GPUs of a node
``LOCAL_WORLD_SIZE`` (TP stays within a node), the global batch is fixed.
``auto`` ranks the legal layouts that fit memory (``plan/autolayout.py``:
``--tenplex-memory-budget`` GB per rank, or the GPU's memory) by the
throughput model; a JSON file is a user's table (``plan/layout_files.py``).
Explicit ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size``
/ ``--micro-batch-size`` still win: they fix that degree.

With no legal layout, the error lists every candidate refused and why, and
under torchrun's elastic agent the worker also asks its agent to stop
(SIGTERM to the agent, which ends the job with a failure): restarting cannot
make an illegal layout legal, so the agent is not left restarting it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass

import torch

from tenplex_megatron.plan.autolayout import DEFAULT_MICRO_BATCH_SIZES, choose_layout
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.layout_files import load_layout_table
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims


@dataclass(frozen=True)
class Chosen:
    layout: ParallelLayout
    micro_batch_size: int
    why: str  # one line for the log


def _dims(args: argparse.Namespace) -> GPTDims:
    return GPTDims(num_layers=args.num_layers, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                   seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, swiglu=args.swiglu,
                   tied=not args.untie_embeddings_and_output_weights, bf16=args.bf16,
                   num_query_groups=args.num_query_groups if args.group_query_attention else None,
                   add_bias_linear=args.add_bias_linear, normalization=args.normalization,
                   position_embedding_type=args.position_embedding_type)


def _memory_gb(args: argparse.Namespace) -> float | None:
    if args.tenplex_memory_budget is not None:
        return float(args.tenplex_memory_budget)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return None  # CPU without a budget: memory does not constrain the choice


def choose(args: argparse.Namespace, world: int, local_world: int) -> Chosen:
    """The layout for ``world`` ranks (``local_world`` per node) from ``args.tenplex_layout``; LayoutError if none."""
    dims = _dims(args)
    if args.tenplex_layout != "auto":
        row = load_layout_table(args.tenplex_layout, dims, gpus_per_node=local_world,
                                global_batch_size=args.global_batch_size).row(world)
        return Chosen(row.layout, row.micro_batch_size, f"from {args.tenplex_layout}")
    fixed = {k: v for k, v in (("tp", args.tensor_model_parallel_size), ("pp", args.pipeline_model_parallel_size))
             if v is not None}
    mbs = (args.micro_batch_size,) if args.micro_batch_size is not None else DEFAULT_MICRO_BATCH_SIZES
    choice = choose_layout(dims, world, local_world, args.global_batch_size, memory_gb=_memory_gb(args),
                           micro_batch_sizes=mbs, fixed=fixed or None,
                           distributed_optimizer=args.use_distributed_optimizer,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    best = choice.best
    return Chosen(best.layout, best.micro_batch_size,
                  f"auto: best of {len(choice.usable)} usable of {len(choice.ranking)} candidates "
                  f"(modelled {best.seconds:.3g} s/iteration)")


def apply(args: argparse.Namespace) -> Chosen | None:
    """Set ``args``' TP, PP and micro-batch size from the chosen layout (None: no ``--tenplex-layout``).

    Raises SystemExit naming every refused candidate; under torchrun's elastic agent it also stops the agent.
    """
    if not args.tenplex_layout:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        chosen = choose(args, world, local_world)
    except (LayoutError, OSError, ValueError) as e:
        # the message first (every rank: whichever survives the agent's shutdown says it), then stop the agent
        print(f"pretrain_gpt.py: error: --tenplex-layout {args.tenplex_layout} at world size {world}: {e}",
              file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("RANK", "0")) == 0 \
                and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
            os.kill(os.getppid(), signal.SIGTERM)  # no restart can help: end the job instead of looping
        raise SystemExit(2) from None
    args.tensor_model_parallel_size = chosen.layout.tp
    args.pipeline_model_parallel_size = chosen.layout.pp
    args.micro_batch_size = chosen.micro_batch_size
    return chosen
