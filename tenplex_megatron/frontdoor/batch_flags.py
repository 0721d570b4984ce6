"""Megatron-LM's batch-size schedule under ``--tenplex``: which one its calculator follows, and the start check that
every batch size still to come splits into micro-batch x the new DP size (``plan/batch_schedule.py`` is the
arithmetic)."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from tenplex_megatron.plan import batch_schedule
from tenplex_megatron.plan.batch_schedule import BatchSchedule, BatchScheduleError
from tenplex_megatron.storage.directory import METADATA_FILE, find_checkpoint, read_checkpoint_metadata
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
        if ckpt is None:
            return 0
        stat = os.stat(os.path.join(ckpt, METADATA_FILE))
        return _position_of(ckpt, stat.st_mtime_ns, stat.st_size)
    except (CheckpointFileError, OSError, ValueError):
        return 0


@functools.lru_cache(maxsize=8)
def _position_of(ckpt: str, mtime_ns: int, size: int) -> int:
    """``ckpt``'s data position, read once per version of its ``metadata.json`` (a start asks up to three times)."""
    return read_checkpoint_metadata(ckpt).data_position


def _schedule_given(args: Any) -> bool:
    """Whether --rampup-batch-size or --step-batch-size-schedule is given (else no position is needed)."""
    return getattr(args, "rampup_batch_size", None) is not None or \
        getattr(args, "step_batch_size_schedule", None) is not None


def _dp_size(args: Any) -> int | None:
    """The DP size Megatron-LM will derive (world / (TP x PP x CP)); None when the world size is not known yet."""
    world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "0") or 0)
    model = (int(getattr(args, "tensor_model_parallel_size", 1) or 1) * int(getattr(args, "pipeline_model_parallel_size",
             1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1))
    return world // model if world and world % model == 0 else None


def _followed(args: Any) -> BatchSchedule | None:
    """The batch ramp or step schedule Megatron-LM follows for ``args``: None for a constant batch or a ramp this
    megatron-core ignores (core_v0.18+); :class:`BatchScheduleError` where its flags are wrong."""
    if not _schedule_given(args):
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
    if dp is None or not _schedule_given(args):
        return []  # no schedule: nothing to check, and the checkpoint's metadata is not read for it
    return problems_at(args, dp, _resume_position(args))


def start_notes(args: Any) -> list[str]:
    """A line where Megatron-LM parses --rampup-batch-size but ignores it (core_v0.18+): tenplex follows it."""
    if getattr(args, "rampup_batch_size", None) is None or rampup_honoured():
        return []
    return [f"{batch_schedule.RAMP_FLAG} is ignored by this megatron-core (deprecated from core_v0.18 for "
            f"{batch_schedule.STEP_FLAG}): tenplex's sampler serves --global-batch-size throughout, as Megatron-LM "
            "does"]
