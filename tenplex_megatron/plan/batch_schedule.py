"""Megatron-LM's global batch size as a function of the consumed samples: constant, ramped, or stepped. Pure.

Megatron-LM asks its micro-batch calculator for the global batch at the consumed-samples position ``c`` before each
iteration, and the iteration then consumes ``[c, c + g(c))``. ``--rampup-batch-size START INCR SAMPLES`` (core_v0.15-
0.17: ``RampupBatchsizeNumMicroBatchesCalculator``) grows it from START by INCR every ``SAMPLES / n`` samples (``n``
increments up to ``--global-batch-size``); ``--step-batch-size-schedule`` (core_v0.18-0.19:
``StepBatchsizeNumMicroBatchesCalculator``) takes the batch of the last threshold (in tokens, over ``--seq-length``)
at or below ``c``. :class:`BatchSchedule` gives the same number for every ``c`` (the same float arithmetic for the
ramp), so tenplex's sampler serves Megatron-LM's batches at any DP size, and a restart resumes at the saved position
with Megatron-LM's batch for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tenplex_megatron.errors import TenplexError

RAMP_FLAG = "--rampup-batch-size"
STEP_FLAG = "--step-batch-size-schedule"
_SUFFIX: Mapping[str, int] = MappingProxyType({"K": 1_000, "M": 1_000_000, "B": 1_000_000_000, "T": 1_000_000_000_000})


class BatchScheduleError(TenplexError, ValueError):
    """A batch-size ramp or step schedule Megatron-LM would reject or crash on; the message names the flag."""


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch at each consumed-samples position; ``flag``: the command line that set it (for messages)."""

    final: int
    ramp: tuple[int, int, int] | None = None  # (start, increment, samples) of --rampup-batch-size
    steps: tuple[tuple[int, int], ...] = ()  # (threshold in samples, batch) of --step-batch-size-schedule, sorted
    flag: str = "--global-batch-size"

    def at(self, consumed: int) -> int:
        """Megatron-LM's current global batch size at ``consumed`` samples."""
        if self.ramp is not None:
            start, incr, samples = self.ramp
            if consumed > samples:
                return self.final
            per_increment = samples / ((self.final - start) // incr)  # Megatron-LM's float, as it computes it
            return start + int(consumed / per_increment) * incr
        if self.steps:
            return next(b for t, b in reversed(self.steps) if consumed >= t)
        return self.final

    def last_change(self) -> int:
        """The position after which the batch no longer changes."""
        if self.ramp is not None:
            return self.ramp[2]
        return self.steps[-1][0] if self.steps else 0

    def batches(self, consumed: int, total: int) -> Iterator[tuple[int, int]]:
        """(first sample, size) of each global batch from ``consumed`` on that fits in ``total`` samples."""
        start = consumed
        while start + (size := self.at(start)) <= total:
            yield start, size
            start += size

    def sizes_from(self, consumed: int, until: int | None = None) -> list[tuple[int, int]]:
        """(first position, size) of each batch size the iterations from ``consumed`` meet, each once, in order;
        ``until``: the training's end in samples (no iteration starts at or past it)."""
        out: list[tuple[int, int]] = []
        c = consumed
        while (until is None or c < until) and (not out or c <= self.last_change()):
            size = self.at(c)
            if not out or out[-1][1] != size:
                out.append((c, size))
            c += size
        if (until is None or c < until) and out[-1][1] != self.final:
            out.append((c, self.final))
        return out

    def divisibility_problems(self, consumed: int, micro_batch_size: int, dp: int,
                              until: int | None = None) -> list[str]:
        """One line per batch size met from ``consumed`` on that micro-batch x DP does not divide, naming the flag,
        the size, where it starts and the DP size (empty when every step splits evenly)."""
        unit = micro_batch_size * dp
        return [f"{self.flag}: the global batch of {size} (from consumed sample {at}) is not divisible by "
                f"--micro-batch-size x DP = {micro_batch_size} x {dp}"
                for at, size in self.sizes_from(consumed, until) if size % unit]


def ramp(start: int, increment: int, samples: int, final: int) -> BatchSchedule:
    """``--rampup-batch-size START INCR SAMPLES`` up to ``--global-batch-size FINAL``, checked as Megatron-LM's
    calculator asserts (and where it would divide by zero: no increment, or no ramp samples)."""
    flag = f"{RAMP_FLAG} {start} {increment} {samples}"
    problem = ("the start batch size must be >= 1" if start < 1 else
               "the increment must be >= 1" if increment < 1 else
               "the ramp-up samples must be >= 1" if samples < 1 else
               f"the start batch size exceeds --global-batch-size {final}" if start > final else
               f"--global-batch-size {final} equals the start batch size: there is nothing to ramp" if start == final
               else f"--global-batch-size {final} - {start} = {final - start} is not a multiple of the increment "
                    f"{increment}" if (final - start) % increment else "")
    if problem:
        raise BatchScheduleError(f"{flag}: {problem}")
    return BatchSchedule(final, ramp=(start, increment, samples), flag=flag)


def _number(text: str, entry: str) -> int:
    """A schedule number as Megatron-LM reads it: a float with an optional K, M, B or T suffix."""
    value = text.strip().upper()
    mult = _SUFFIX.get(value[-1:], 1)
    value = value[:-1] if value[-1:] in _SUFFIX else value
    try:
        return int(float(value) * mult)
    except ValueError:
        raise BatchScheduleError(f"{STEP_FLAG}: {entry!r} is not THRESHOLD:BATCH_SIZE with numbers") from None


def steps(schedule: str, seq_length: int | None) -> BatchSchedule:
    """``--step-batch-size-schedule "THRESHOLD:BS ..."`` (thresholds in tokens when ``seq_length`` is given, as
    pretrain_gpt.py gives it, else samples), checked as Megatron-LM's calculator asserts."""
    pairs = []
    for entry in re.split(r"[\s,]+", schedule.strip()):
        if ":" not in entry:
            raise BatchScheduleError(f"{STEP_FLAG} {schedule!r}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        t, b = entry.split(":", 1)
        threshold, batch = _number(t, entry), _number(b, entry)
        pairs.append((threshold // seq_length if seq_length else threshold, batch))
    pairs.sort(key=lambda p: p[0])
    flag = f"{STEP_FLAG} {schedule!r}"
    if pairs[0][0] != 0:
        raise BatchScheduleError(f"{flag}: the first threshold must be 0 (it is {pairs[0][0]} samples)")
    if any(a[0] == b[0] for a, b in zip(pairs, pairs[1:])):
        raise BatchScheduleError(f"{flag}: two thresholds fall on the same sample")
    if any(b < 1 for _, b in pairs):
        raise BatchScheduleError(f"{flag}: every batch size must be >= 1")
    return BatchSchedule(pairs[-1][1], steps=tuple(pairs), flag=flag)


def constant(global_batch_size: int) -> BatchSchedule:
    """One global batch size throughout."""
    return BatchSchedule(global_batch_size, flag=f"--global-batch-size {global_batch_size}")


def for_megatron(global_batch_size: int, rampup: list[str] | None, step_schedule: str | None,
                 seq_length: int | None, rampup_honoured: bool) -> BatchSchedule:
    """The schedule Megatron-LM's calculator follows for its parsed flags: the step schedule where given
    (core_v0.18+), the ramp where the installed megatron-core still has one (``rampup_honoured``: up to core_v0.17;
    from 0.18 Megatron-LM parses --rampup-batch-size but ignores it), else the constant ``--global-batch-size``."""
    if step_schedule is not None:
        return steps(step_schedule, seq_length)
    if rampup is not None and rampup_honoured:
        if len(rampup) != 3:
            raise BatchScheduleError(f"{RAMP_FLAG} {' '.join(map(str, rampup))}: expected START INCREMENT SAMPLES")
        start, increment, samples = (int(v) for v in rampup)
        return ramp(start, increment, samples, int(global_batch_size))
    return constant(int(global_batch_size))
