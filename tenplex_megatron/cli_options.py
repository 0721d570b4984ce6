"""The options the CLI's planning commands share (``plan``, ``layouts``, ``simulate``): the model, the machine and
the job, each defined once with one default, so the three commands cannot drift apart (docs/cli.md lists them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.autolayout import Hardware

#: ``--gpus-per-node`` when neither the flag nor a trace says it: one 8-GPU node (``layouts`` keeps TP within it)
GPUS_PER_NODE = 8
#: ``--memory-gb``: an 80 GiB GPU's memory per rank
MEMORY_GB = 80.0
#: ``--global-batch-size``: kept the same at every world size
GLOBAL_BATCH_SIZE = 512


def _model(g: Any, required: bool) -> None:
    g.add_argument("--model", required=required,
                   help="a model in the packaged catalogue, e.g. gpt3-1.3b (plan: instead of a checkpoint)")


def _gpus_per_node(g: Any, required: bool) -> None:
    g.add_argument("--gpus-per-node", type=int, default=None, required=required,
                   help=f"GPUs per node (default: the trace's for simulate; no cross-node figures for plan; "
                        f"{GPUS_PER_NODE} for layouts, whose TP stays within a node)")


def _memory_gb(g: Any, required: bool) -> None:
    g.add_argument("--memory-gb", type=float, default=MEMORY_GB, required=required,
                   help="memory budget per rank in GiB (default %(default)g)")


def _global_batch_size(g: Any, required: bool) -> None:
    g.add_argument("--global-batch-size", type=int, default=GLOBAL_BATCH_SIZE, required=required,
                   help="fixed at every world size (default %(default)s)")


def _tflops_per_gpu(g: Any, required: bool) -> None:
    g.add_argument("--tflops-per-gpu", type=float, default=Hardware().flops_per_gpu / 1e12, required=required,
                   help="achieved TFLOP/s per GPU for the modelled times (default %(default)g)")


def _distributed_optimizer(g: Any, required: bool) -> None:
    g.add_argument("--distributed-optimizer", dest="distributed_optimizer", action="store_true", default=None,
                   help="the job uses Megatron's distributed optimizer (default: a checkpoint's setting, else on)")
    g.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false",
                   help="the job uses the plain optimizer (every DP rank holds the whole optimizer state)")


_OPTIONS: Mapping[str, Callable[[Any, bool], None]] = MappingProxyType({
    "model": _model, "gpus_per_node": _gpus_per_node, "memory_gb": _memory_gb,
    "global_batch_size": _global_batch_size, "tflops_per_gpu": _tflops_per_gpu,
    "distributed_optimizer": _distributed_optimizer,
})
ALL = tuple(_OPTIONS)


def add_job_options(parser: argparse.ArgumentParser, which: Sequence[str] = ALL, *,
                    required: Sequence[str] = ()) -> None:
    """Add the shared options named in ``which`` (keys of :data:`ALL`) to ``parser`` as one group, those in
    ``required`` required."""
    unknown = sorted(set(which) - set(_OPTIONS)) + sorted(set(required) - set(which))
    if unknown:
        raise ValueError(f"add_job_options: unknown or unused option(s) {', '.join(unknown)}")
    g = parser.add_argument_group("model, machine and job")
    for name in which:
        _OPTIONS[name](g, name in required)


def distributed_optimizer(args: argparse.Namespace, saved: bool | None = None) -> bool:
    """``--(no-)distributed-optimizer``, else the checkpoint's ``saved`` setting, else on."""
    if args.distributed_optimizer is not None:
        return bool(args.distributed_optimizer)
    return True if saved is None else bool(saved)


def gpus_per_node(args: argparse.Namespace) -> int:
    """``--gpus-per-node``, else :data:`GPUS_PER_NODE`."""
    return GPUS_PER_NODE if args.gpus_per_node is None else int(args.gpus_per_node)
