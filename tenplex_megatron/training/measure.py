"""``--tenplex-layout measure``: time the best few candidate layouts in the running processes, once per world size.

Collective, after the process group exists and before the job is built: the
best ``TRIALS`` usable candidates by the throughput model that have no measured
time at this world size yet are tried in turn, in the same processes:
megatron-core's parallel state is torn down and initialised again for the
candidate, the model and optimizer are built, the state of the newest tenplex
checkpoint (if there is one) is loaded into them re-sharded to the candidate,
and forward+backward over a global batch (with its DP gradient reduction) is
timed for a few iterations; no optimizer step is taken. A candidate's time is
the median over its timed iterations of the slowest rank's. The times go into
``tenplex_layout_times.json`` (versioned JSON, ``plan/layout_files.py``) in
the checkpoint directory, keyed by world size and candidate, and the layout is
chosen again with them: measured times rank ahead of modelled ones, so a later
start at the same world size reads the file and runs no trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from megatron.core import parallel_state

from tenplex_megatron.integrations.megatron_core.adapter import load_job
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.layout_choice import MEASURE_TIMED, MEASURE_TRIALS, MEASURE_WARMUP, choose, rank, to_measure
from tenplex_megatron.plan.layout_files import read_layout_times, with_measurement, write_layout_times
from tenplex_megatron.plan.pipeline_split import even
from tenplex_megatron.storage.directory import find_checkpoint, read_checkpoint_metadata
from tenplex_megatron.training import gpt, layout_choice, pipeline_flags
from tenplex_megatron.training.console import print0 as _print0
from tenplex_megatron.training.gpt import GPTSpec
from tenplex_megatron.training.synthetic_data import microbatches

TRIALS = MEASURE_TRIALS  # candidates timed at a new world size (plan/simulate.py counts their cost too)
WARMUP, TIMED = MEASURE_WARMUP, MEASURE_TIMED  # iterations per candidate: not timed, timed


def _time_candidate(spec: GPTSpec, args: argparse.Namespace, tp: int, pp: int, mbs: int,
                    ckpt: str | None, ep: int = 1, vpp: int = 1, etp: int = 0) -> float:
    """Collective: seconds per forward+backward of one global batch at (tp, pp, mbs; EP and expert TP for a mixture
    of experts, VPP for an interleaved pipeline), the slowest rank's median."""
    world = torch.distributed.get_world_size()
    rule = pipeline_flags.split_rule(args)  # an uneven pipeline: the candidate's split (the choice kept to fits)
    layout = ParallelLayout(tp, pp, world // (tp * pp), vpp=vpp, sp=bool(args.sequence_parallel and tp > 1), ep=ep,
                            etp=etp, split=even(rule.counts(spec.num_layers, pp, vpp)) if rule.given else ())
    saved = read_checkpoint_metadata(ckpt).padded_vocab_size if ckpt else None
    padded = (restart_padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, tp, saved)
              if args.tenplex_vocab_padding == "keep"
              else padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, tp))
    job = gpt.build_job(spec, layout, use_distributed_optimizer=args.use_distributed_optimizer,
                        micro_batch_size=mbs, global_batch_size=args.global_batch_size, padded_vocab=padded)
    if ckpt is not None:
        load_job(job, ckpt, verify=False)  # the state re-sharded to the candidate; the real start verifies
    dp_rank = parallel_state.get_data_parallel_rank()
    seconds = []
    for _ in range(WARMUP + TIMED):
        data = microbatches(job.consumed_samples, job.global_batch_size, mbs, layout.dp, dp_rank,
                            spec.seq_length, spec.vocab_size, spec.seed)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        gpt.forward_backward(job, data)  # no optimizer step: the state stays the checkpoint's
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(seconds[WARMUP:])], dtype=torch.float64,
                           device="cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)  # every rank chooses alike
    del job
    parallel_state.destroy_model_parallel()
    return float(slowest.item())


def measure_and_choose(args: argparse.Namespace, spec: GPTSpec) -> int:
    """Collective: time the untimed top candidates (if any), keep the times, set ``args``' layout from them.

    Returns the number of candidates timed (0: every one had a kept time at this world size)."""
    world = torch.distributed.get_world_size()
    req = args.tenplex_layout_request
    path = layout_choice.times_path(args)
    if path is None:
        raise SystemExit("pretrain_gpt.py: error: --tenplex-layout measure keeps its times in the checkpoint "
                         "directory: give --save (or --load)")
    times = read_layout_times(path)
    measured = times.get(world, {})
    todo = to_measure(rank(req, measured), measured, TRIALS)
    if not todo:
        _print0(f"> tenplex-megatron: --tenplex-layout measure: {len(measured)} times for world size {world} "
                f"from {path}: no trial")
        return 0
    ckpt = find_checkpoint(args.load) if (args.load and args.tenplex) else None
    _print0(f"> tenplex-megatron: --tenplex-layout measure: timing {len(todo)} candidates at world size {world}"
            + (f" from {ckpt}" if ckpt else ""))
    for c in todo:
        s = _time_candidate(spec, args, c.layout.tp, c.layout.pp, c.micro_batch_size, ckpt, c.layout.ep,
                            c.layout.vpp, c.layout.etp)
        times = with_measurement(times, world, c.key, s)
        _print0(f"> tenplex-megatron: measured {c.key}: {s * 1000:.1f} ms per forward+backward "
                f"(modelled {c.seconds:.3g} s)")
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_layout_times(path, times)
    torch.distributed.barrier()
    chosen = choose(req, times[world])
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = chosen.layout.tp, chosen.layout.pp
    args.expert_model_parallel_size = chosen.layout.ep
    if spec.num_experts:
        args.expert_tensor_parallel_size = chosen.layout.expert_tp
    args.virtual_pipeline_model_parallel_size = chosen.layout.vpp
    args.micro_batch_size = chosen.micro_batch_size
    args.tenplex_layout_why = chosen.why
    return len(todo)
