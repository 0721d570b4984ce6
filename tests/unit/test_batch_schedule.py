"""Megatron-LM's batch-size ramp under --tenplex: tenplex's schedule and sampler against megatron-core's own
calculator (RampupBatchsizeNumMicroBatchesCalculator), across DP sizes and a restart inside the ramp; the start
check's refusal of a ramp the new DP size does not divide; core_v0.18's step schedule."""

from __future__ import annotations

import argparse
import json

import megatron.core.num_microbatches_calculator as calc_mod
import pytest

from tenplex_megatron.frontdoor import batch_flags
from tenplex_megatron.frontdoor.megatron_lm import TenplexBatchSampler
from tenplex_megatron.plan import batch_schedule
from tenplex_megatron.plan.batch_schedule import BatchScheduleError
from tenplex_megatron.storage import directory

Rampup = calc_mod.RampupBatchsizeNumMicroBatchesCalculator

# (start, increment, ramp samples, global batch): the oracle test's, uneven increments, GPT-3 175B's example
RAMPS = [(2, 2, 16, 8), (4, 4, 50, 16), (16, 8, 3000, 256), (16, 16, 5859375, 1536), (8, 8, 7, 32)]


def _megatron(ramp: tuple[int, int, int, int], mbs: int, dp: int, consumed: int, total: int) -> list[tuple[int, int, int]]:
    """(first sample, global batch, micro-batches per DP rank) of each iteration from ``consumed`` as Megatron-LM's
    training loop takes them: ``update_num_microbatches(consumed)`` then ``consumed += the batch``."""
    start, incr, samples, gbs = ramp
    calc = Rampup(gbs, mbs, dp, False, 1, start, incr, samples)
    out, c = [], consumed
    while True:
        calc.update(c, consistency_check=True)
        g = calc.get_current_global_batch_size()
        if c + g > total:
            return out
        out.append((c, g, calc.get()))
        c += g


def _sampled(ramp: tuple[int, int, int, int], mbs: int, dp: int, consumed: int,
             total: int) -> list[tuple[int, int, int]]:
    """The same from tenplex's sampler: every DP rank's micro-batches, cut by the schedule's batch sizes, each
    iteration's samples checked to be exactly [c, c + g)."""
    schedule = batch_schedule.ramp(*ramp)
    ranks = [iter(TenplexBatchSampler(total, consumed, schedule, mbs, dp, r)) for r in range(dp)]
    out = []
    for c, g in schedule.batches(consumed, total):
        n = g // (mbs * dp)
        got = sorted(i for it in ranks for _ in range(n) for i in next(it))
        assert got == list(range(c, c + g)), (c, g)
        out.append((c, g, n))
    assert all(next(it, None) is None for it in ranks)  # nothing past the last whole batch
    return out


@pytest.mark.parametrize("ramp", RAMPS[:3])
@pytest.mark.parametrize("mbs,dp", [(1, 1), (1, 2), (2, 1)])
def test_sampler_follows_megatrons_ramp_at_any_dp(ramp: tuple[int, int, int, int], mbs: int, dp: int) -> None:
    total = ramp[2] + 5 * ramp[3]  # through the ramp and past it
    if any(g % (mbs * dp) for _, g in batch_schedule.ramp(*ramp).sizes_from(0)):
        pytest.fail(f"test case {ramp} does not split at micro-batch {mbs} x DP {dp}")
    want = _megatron(ramp, mbs, dp, 0, total)
    assert _sampled(ramp, mbs, dp, 0, total) == want
    assert len({g for _, g, _ in want}) > 2  # the ramp is exercised, then the final batch


@pytest.mark.parametrize("ramp", RAMPS)
def test_batch_at_every_position_equals_megatrons(ramp: tuple[int, int, int, int]) -> None:
    start, incr, samples, gbs = ramp
    calc = Rampup(gbs, 1, 1, False, 1, start, incr, samples)
    schedule = batch_schedule.ramp(*ramp)
    step = max(1, samples // 20000)
    for c in [*range(0, samples + 2 * gbs, step), samples - 1, samples, samples + 1]:
        calc.update(c, consistency_check=False)
        assert schedule.at(c) == calc.get_current_global_batch_size(), c


@pytest.mark.parametrize("before,after", [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((1, 2), (2, 1))])
def test_restart_inside_the_ramp_at_another_dp_resumes_megatrons_batches(before: tuple[int, int],
                                                                         after: tuple[int, int]) -> None:
    ramp, total = RAMPS[0], 60
    first = _sampled(ramp, *before, 0, total)
    k = 4  # the oracle test's save: iteration 4, inside the ramp (its batch grows after it)
    resumed_at = first[k][0]
    assert resumed_at < ramp[2] and first[k][1] < ramp[3]
    assert _sampled(ramp, *after, resumed_at, total) == _megatron(ramp, *after, resumed_at, total)
    assert [(c, g) for c, g, _ in _sampled(ramp, *after, resumed_at, total)] == [(c, g) for c, g, _ in first[k:]]


def _args(**kw) -> argparse.Namespace:
    base = dict(tenplex=True, load=None, global_batch_size=8, micro_batch_size=1, world_size=4,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                train_samples=60, rampup_batch_size=[2, 2, 16])
    return argparse.Namespace(**{**base, **kw})


def test_a_ramp_the_new_dp_does_not_divide_is_refused_at_start_naming_flag_size_and_dp() -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    problems, _ = megatron_lm.start_check(_args(), [])
    assert problems == [f"--rampup-batch-size 2 2 16: the global batch of {g} (from consumed sample {c}) is not "
                        f"divisible by --micro-batch-size x DP = 1 x 4"
                        for c, g in batch_schedule.ramp(2, 2, 16, 8).sizes_from(0) if g % 4]
    assert len(problems) == 2  # 2 and 6
    assert megatron_lm.start_check(_args(world_size=2), [])[0] == []  # DP 2 divides 2, 4, 6 and 8
    assert megatron_lm.start_check(_args(world_size=4, tensor_model_parallel_size=2), [])[0] == []
    # past the ramp only the final batch is to come: DP 8 is fine there, and refused from the start
    assert batch_schedule.ramp(2, 2, 16, 8).divisibility_problems(20, 1, 8) == []
    assert len(batch_schedule.ramp(2, 2, 16, 8).divisibility_problems(0, 1, 8)) == 3


def test_the_hook_stops_on_a_ramp_before_megatron_lm_checks_anything(caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit) as e:
        megatron_lm._validate_args(_args(micro_batch_size=4, world_size=1))
    assert e.value.code == 2
    assert ("pretrain_gpt.py: with --tenplex, --rampup-batch-size 2 2 16: the global batch of 2 (from consumed "
            "sample 0) is not divisible by --micro-batch-size x DP = 4 x 1") in caplog.text


@pytest.mark.parametrize("ramp,why", [((0, 2, 16, 8), "start batch size must be >= 1"),
                                      ((2, 0, 16, 8), "increment must be >= 1"),
                                      ((2, 2, 0, 8), "ramp-up samples must be >= 1"),
                                      ((16, 2, 16, 8), "exceeds --global-batch-size 8"),
                                      ((8, 2, 16, 8), "nothing to ramp"),
                                      ((2, 4, 16, 8), "8 - 2 = 6 is not a multiple of the increment 4")])
def test_a_ramp_megatron_would_reject_is_one_line_naming_it(ramp: tuple[int, int, int, int], why: str) -> None:
    with pytest.raises(BatchScheduleError, match="^--rampup-batch-size " + " ".join(map(str, ramp[:3])) + ": .*"
                       + why):
        batch_schedule.ramp(*ramp)
    problems = batch_flags.start_problems(_args(rampup_batch_size=list(ramp[:3]), global_batch_size=ramp[3]))
    assert len(problems) == 1 and why in problems[0]


def test_step_schedule_takes_the_last_threshold_at_or_below_the_position_in_tokens() -> None:
    seq = 64
    schedule = batch_schedule.steps("0:4 1K:8, 2.5K:16", seq)
    thresholds = [0, 1000 // seq, 2500 // seq]  # tokens over --seq-length, as Megatron-LM's calculator
    assert schedule.steps == tuple(zip(thresholds, (4, 8, 16))) and schedule.final == 16
    for c in range(0, 80):
        assert schedule.at(c) == [b for t, b in schedule.steps if c >= t][-1]
    got = list(schedule.batches(0, 120))
    assert [g for _, g in got] == [schedule.at(c) for c, _ in got] and got[0] == (0, 4)
    assert all(b == a + g for (a, g), (b, _) in zip(got, got[1:]))
    assert batch_schedule.steps("0:4 64:8", None).at(64) == 8  # without a sequence length: samples
    assert schedule.divisibility_problems(0, 1, 8)[0].startswith("--step-batch-size-schedule '0:4 1K:8, 2.5K:16': "
                                                                 "the global batch of 4 (from consumed sample 0)")
    for bad, why in [("10:4", "first threshold must be 0"), ("0:4 0:8", "same sample"), ("0:4 x", "entry 'x'"),
                     ("0:0", "batch size must be >= 1"), ("0:a", "with numbers")]:
        with pytest.raises(BatchScheduleError, match=why):
            batch_schedule.steps(bad, None)


def test_megatron_lms_choice_of_schedule() -> None:
    assert batch_schedule.for_megatron(8, [2, 2, 16], None, 64, True).ramp == (2, 2, 16)
    assert batch_schedule.for_megatron(8, [2, 2, 16], None, 64, False) == batch_schedule.constant(8)  # core_v0.18+
    assert batch_schedule.for_megatron(2, None, "0:4 128:8", 64, False).steps == ((0, 4), (2, 8))
    assert batch_flags.rampup_honoured() == hasattr(calc_mod, "RampupBatchsizeNumMicroBatchesCalculator")


def test_an_in_place_shrink_or_grow_admits_only_world_sizes_the_ramp_still_to_come_splits_over() -> None:
    from tenplex_megatron.frontdoor import megatron_lm_inprocess

    args = _args(expert_model_parallel_size=1, consumed_train_samples=6)  # next batches: 4, 4, 6, 8, ...
    reasons = {n: megatron_lm_inprocess.fixed_layout_reason(args, n) for n in (1, 2, 4)}
    assert reasons[1] == reasons[2] == ""
    assert reasons[4] == ("--rampup-batch-size 2 2 16: the global batch of 6 (from consumed sample 14) is not "
                          "divisible by --micro-batch-size x DP = 1 x 4")
    args.consumed_train_samples = 20  # past the ramp: only the final 8
    assert megatron_lm_inprocess.fixed_layout_reason(args, 8) == ""


def _saved_at(root, consumed: int) -> None:
    d = root / directory.iter_dir_name(4)
    d.mkdir(exist_ok=True)
    (d / directory.METADATA_FILE).write_text(json.dumps(
        {"format": directory.FORMAT_NAME, "format_version": directory.FORMAT_VERSION, "iteration": 4,
         "framework": "megatron-core", "consumed_samples": consumed}))


def test_a_start_reads_the_checkpoints_position_only_for_a_schedule_and_once(tmp_path, monkeypatch) -> None:
    """Without a ramp or step schedule the start check reads no metadata.json; with one, the three questions of a
    start (the check, the batch sizes to come, the check after the layout choice) read it once, and again only
    when the file changes."""
    reads = []
    real = batch_flags.read_checkpoint_metadata
    monkeypatch.setattr(batch_flags, "read_checkpoint_metadata", lambda d: reads.append(d) or real(d))
    _saved_at(tmp_path, 12)
    plain = _args(load=str(tmp_path), rampup_batch_size=None)
    assert batch_flags.start_problems(plain) == [] and batch_flags.sizes_to_come(plain) == () and reads == []
    ramped = _args(load=str(tmp_path), world_size=2)
    assert batch_flags.start_problems(ramped) == []
    assert batch_flags.sizes_to_come(ramped)[0] == batch_schedule.ramp(2, 2, 16, 8).at(12) == 6
    assert batch_flags.start_problems(ramped) == [] and len(reads) == 1
    _saved_at(tmp_path, 9)  # another checkpoint's metadata (another size) in its place: read again
    assert batch_flags.sizes_to_come(ramped)[0] == batch_schedule.ramp(2, 2, 16, 8).at(9) and len(reads) == 2
