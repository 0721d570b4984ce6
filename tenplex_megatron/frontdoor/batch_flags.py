"""Megatron-LM's batch-size schedule under ``--tenplex``: which one its calculator follows, and the start check that
every batch size still to come splits into micro-batch x the new DP size (``plan/batch_schedule.py`` is the
arithmetic)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from tenplex_megatron.plan import batch_schedule
from tenplex_megatron.plan.batch_schedule import BatchSchedule, BatchScheduleError
from tenplex_megatron.storage.directory import find_checkpoint, read_checkpoint_metadata
from tenplex_megatron.storage.files import CheckpointFileError


def rampup_honoured() -> bool:
    """Whether the installed megatron-core ramps the batch for --rampup-batch-size (up to core_v0.17; from 0.18 the
    flag is parsed and ignored, the step schedule replacing it)."""
    try:
        calc = importlib.import_module("megatron.core.num_microbatches_calculator")
    except ImportError:
        return False
    return hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator")


def schedule_for_args(args: Any) -> BatchSchedule:
    """The global batch at each consumed position that Megatron-LM's calculator gives for its parsed ``args``."""
    return batch_schedule.for_megatron(
        int(getattr(args, "global_batch_size", None) or 0), getattr(args, "rampup_batch_size", None),
        getattr(args, "step_batch_size_schedule", None), getattr(args, "seq_length", None), rampup_honoured())


def _resume_position(args: Any) -> int:
    """The consumed samples of the newest tenplex checkpoint under ``--load`` (0 when none, with --finetune, or
    unreadable: then every batch size of the schedule is checked, the stricter choice)."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "finetune", False) or not os.path.isdir(load):
        return 0
    try:
        ckpt = find_checkpoint(load)
        return read_checkpoint_metadata(ckpt).data_position if ckpt is not None else 0
    except (CheckpointFileError, OSError, ValueError):
        return 0


def _dp_size(args: Any) -> int | None:
    """The DP size Megatron-LM will derive (world / (TP x PP x CP)); None when the world size is not known yet."""
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "0") or 0)
    model = (int(getattr(args, "tensor_model_parallel_size", 1) or 1) * int(getattr(args, "pipeline_model_parallel_size",
             1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1))
    return world // model if world and world % model == 0 else None


def _followed(args: Any) -> BatchSchedule | None:
    """The batch ramp or step schedule Megatron-LM follows for ``args``: None for a constant batch or a ramp this
    megatron-core ignores (core_v0.18+); :class:`BatchScheduleError` where its flags are wrong."""
    if getattr(args, "rampup_batch_size", None) is None and getattr(args, "step_batch_size_schedule", None) is None:
        return None
    schedule = schedule_for_args(args)
    return schedule if schedule.ramp is not None or schedule.steps else None


def problems_at(args: Any, dp: int, consumed: int) -> list[str]:
    """With a batch ramp or step schedule Megatron-LM follows: one line per batch size from ``consumed`` on that
    micro-batch x ``dp`` does not divide, or the schedule's own error; none otherwise."""
    try:
        schedule = _followed(args)
    except BatchScheduleError as e:
        return [str(e)]
    mbs = getattr(args, "micro_batch_size", None)
    if schedule is None or not mbs:
        return []  # no schedule Megatron-LM follows, or its own check of the sizes comes first
    until = getattr(args, "train_samples", None)
    return schedule.divisibility_problems(consumed, int(mbs), dp, int(until) if until else None)


def sizes_to_come(args: Any) -> tuple[int, ...]:
    """The global batch sizes of a ramp or step schedule Megatron-LM follows, from the position this start resumes
    at to the end of training (empty without one, or where the schedule itself is refused: its check names it)."""
    try:
        schedule = _followed(args)
    except BatchScheduleError:
        return ()
    if schedule is None:
        return ()
    until = getattr(args, "train_samples", None)
    return tuple(size for _, size in schedule.sizes_from(_resume_position(args), int(until) if until else None))


def start_problems(args: Any) -> list[str]:
    """:func:`problems_at` for the DP size of this start, from the position of the checkpoint it will load."""
    dp = _dp_size(args)
    if dp is None:
        return []
    return problems_at(args, dp, _resume_position(args))


def start_notes(args: Any) -> list[str]:
    """A line where Megatron-LM parses --rampup-batch-size but ignores it (core_v0.18+): tenplex follows it."""
    if getattr(args, "rampup_batch_size", None) is None or rampup_honoured():
        return []
    return [f"{batch_schedule.RAMP_FLAG} is ignored by this megatron-core (deprecated from core_v0.18 for "
            f"{batch_schedule.STEP_FLAG}): tenplex's sampler serves --global-batch-size throughout, as Megatron-LM "
            "does"]
