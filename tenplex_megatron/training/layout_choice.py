"""``--tenplex-layout auto | measure | FILE.json`` in the reference trainer: the layout and micro-batch size for
the world size torchrun gave us.

Runs on every start and every restart torchrun makes, before any process
group exists: the world size is ``WORLD_SIZE``, the GPUs of a node
``LOCAL_WORLD_SIZE`` (TP stays within a node), the global batch is fixed.
``auto`` ranks the legal layouts that fit memory (``plan/autolayout.py``:
``--tenplex-memory-budget`` GB per rank, or the GPU's memory) by the
throughput model; ``measure`` ranks iteration times measured at this world
size (``training/measure.py`` times the best few first, once) ahead of the
model; a JSON file is a user's table (``plan/layout_files.py``). Explicit
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` /
``--expert-model-parallel-size`` / ``--expert-tensor-parallel-size`` / ``--micro-batch-size`` still win: they fix
that degree. For a mixture of experts EP and expert TP are chosen too (expert TP may differ from TP; at TP > 1 only
with ``--sequence-parallel``, which megatron-core needs there).

With no legal layout, the error lists every candidate refused and why, and
under torchrun's elastic agent the worker also asks its agent to stop
(``frontdoor/elastic.refuse``): restarting cannot make an illegal layout legal.
"""

from __future__ import annotations

import argparse
import os

from tenplex_megatron.frontdoor import elastic
from tenplex_megatron.frontdoor.dims import gpt_dims
from tenplex_megatron.plan.layout import LayoutError
from tenplex_megatron.plan.layout_choice import Chosen, LayoutRequest, choose
from tenplex_megatron.plan.layout_files import LAYOUT_TIMES_FILE, read_layout_times
from tenplex_megatron.training import pipeline_flags


def request(args: argparse.Namespace, world: int, local_world: int) -> LayoutRequest:
    """The trainer's flags as a layout request for ``world`` ranks (``local_world`` per node)."""
    return LayoutRequest(args.tenplex_layout, gpt_dims(args), world, local_world, args.global_batch_size,
                         memory_gb=elastic.memory_gb(args.tenplex_memory_budget),
                         tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                         micro_batch_size=args.micro_batch_size, ep=args.expert_model_parallel_size,
                         distributed_optimizer=args.use_distributed_optimizer,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         expert_tp=args.expert_tensor_parallel_size, sequence_parallel=bool(args.sequence_parallel),
                         split=pipeline_flags.split_rule(args))


def times_path(args: argparse.Namespace) -> str | None:
    """Where ``measure`` keeps its times: the checkpoint directory (``--save``, else ``--load``)."""
    where = args.save or args.load
    return os.path.join(where, LAYOUT_TIMES_FILE) if where else None


def measured_times(args: argparse.Namespace, world: int) -> dict[str, float]:
    """``measure``: the iteration times kept for ``world`` (empty for auto, a table, or nothing measured yet)."""
    path = times_path(args) if args.tenplex_layout == "measure" else None
    return read_layout_times(path).get(world, {}) if path else {}


def choose_for(args: argparse.Namespace, world: int, local_world: int) -> Chosen:
    """The layout for ``world`` ranks from ``args.tenplex_layout``; LayoutError if none."""
    return choose(request(args, world, local_world), measured_times(args, world))


def apply(args: argparse.Namespace) -> Chosen | None:
    """Set ``args``' TP, PP, EP, expert TP, VPP and micro-batch size from the chosen layout (None: no
    ``--tenplex-layout``).

    Raises SystemExit naming every refused candidate; under torchrun's elastic agent it also stops the agent.
    """
    if not args.tenplex_layout:
        return None
    world, local_world = elastic.world()
    args.tenplex_layout_request = None
    try:
        for flag in ("num_layers_per_virtual_pipeline_stage",
                     "num_virtual_stages_per_pipeline_rank"):  # the choice decides VPP itself (1 or interleaved)
            if getattr(args, flag) is not None:
                raise LayoutError(f"--{flag.replace('_', '-')} is not modelled by --tenplex-layout: give the layout "
                                  "explicitly")
        req = request(args, world, local_world)
        chosen = choose(req, measured_times(args, world))
    except (LayoutError, OSError, ValueError) as e:
        elastic.refuse("pretrain_gpt.py", args.tenplex_layout, world, e)
    args.tenplex_layout_request = req  # measure: the candidates to time are ranked from it
    args.tensor_model_parallel_size = chosen.layout.tp
    args.pipeline_model_parallel_size = chosen.layout.pp
    args.expert_model_parallel_size = chosen.layout.ep
    if args.num_experts:
        args.expert_tensor_parallel_size = chosen.layout.expert_tp
    if chosen.layout.vpp > 1:  # an interleaved pipeline (read by virtual_stages, as if given on the command line)
        args.num_virtual_stages_per_pipeline_rank = chosen.layout.vpp
    args.micro_batch_size = chosen.micro_batch_size
    return chosen
