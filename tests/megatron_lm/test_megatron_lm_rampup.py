"""Opt-in: Megatron-LM's batch-size ramp under --tenplex, through its own ``pretrain_gpt.py`` (``MEGATRON_LM_PATH``).

Sample-based training (``--train-samples 44``, ``--lr-decay-samples``, ``--lr-warmup-samples``, micro-batch 1) whose
global batch grows 2, 4, 6, 8: ``--rampup-batch-size 2 2 16`` up to core_v0.17; from core_v0.18 Megatron-LM parses
that flag and ignores it, and its ``--step-batch-size-schedule`` (thresholds in tokens of ``--seq-length 64``) gives
the same batches. The reference is stock Megatron-LM without --tenplex at TP1 x DP2 (the first run's layout: the
initial weights depend on TP), uninterrupted (9 iterations). With --tenplex: TP1 x DP2 saves at iteration 4, inside
the ramp, and exits; TP2 (DP1) loads it and trains through the ramp and past it. Every iteration's consumed samples
and loss equal the reference's. A restart at DP2 with micro-batch 2 is refused at start: the batch of 6 still to come
does not split into 2 x 2.
"""

from __future__ import annotations

import json
import re

import pytest

from tenplex_megatron.plan import batch_schedule
from tests.megatron_lm.test_megatron_lm import FLAGS, MLM, RELEASE, _log_lines, _losses, _run, patched_script

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]

TRAIN_SAMPLES = 44
_DROPPED = {"--train-iters", "--lr-warmup-iters", "--global-batch-size", "--micro-batch-size"}


def _sample_based() -> list[str]:
    """FLAGS for sample-based training at micro-batch 1 (the iteration-based flags and the batch sizes left out)."""
    out, it = [], iter(FLAGS)
    for f in it:
        if f in _DROPPED:
            next(it)
        else:
            out.append(f)
    return [*out, "--micro-batch-size", "1", "--train-samples", str(TRAIN_SAMPLES), "--lr-decay-samples",
            str(TRAIN_SAMPLES), "--lr-warmup-samples", "4"]


def _schedule() -> tuple[list[str], batch_schedule.BatchSchedule]:
    """The release line's flags for the ramp 2, 4, 6, 8 over 16 samples, and tenplex's schedule for them."""
    if RELEASE[:2] < (0, 18):
        return (["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "8"],
                batch_schedule.ramp(2, 2, 16, 8))
    text = "0:2 384:4 896:6 1280:8"  # samples 0, 6, 14, 20 (x 64 tokens): the ramp's batches exactly
    return ["--step-batch-size-schedule", text], batch_schedule.steps(text, 64)


def test_megatron_lm_rampup_restart_inside_the_ramp_at_another_layout_continues_losses(tmp_path) -> None:
    script, base, (flags, schedule) = patched_script(tmp_path), _sample_based(), _schedule()
    log = _run(script, 1, 95, flags, tenplex=False, base=base)  # layout A: Megatron-LM's own sampler at DP2
    assert "> tenplex" not in log, log[-3000:]
    ref, ref_lines = _losses(log), [(it, c) for it, c, _ in _log_lines(log)]
    assert sorted(ref) == list(range(1, 10)), log[-3000:]
    sizes = [c - prev for (_, c), prev in zip(ref_lines, [0] + [c for _, c in ref_lines])]
    assert sizes == [g for _, g in schedule.batches(0, TRAIN_SAMPLES)], sizes  # Megatron-LM's ramp, as ours says
    assert sorted(set(sizes)) == [2, 4, 6, 8], sizes

    ckpt = tmp_path / "ckpt"
    log = _run(script, 1, 95, [*flags, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"], base=base)
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    meta = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2} and meta["consumed_samples"] == ref_lines[3][1]
    assert meta["consumed_samples"] < 16 and sizes[4] > sizes[0]  # inside the ramp, its batch still to grow
    first = _log_lines(log)
    assert [(it, c) for it, c, _ in first] == ref_lines[:4], first
    got = _losses(log)

    log = _run(script, 2, 95, [*flags, "--load", str(ckpt)], base=base)
    assert re.search(r"> tenplex: loaded iteration 4 from \S+: layout tp=1,pp=1,dp=2 -> tp=2,pp=1,dp=1", log), \
        log[-3000:]
    second = _log_lines(log)
    assert [(it, c) for it, c, _ in second] == ref_lines[4:], second
    got.update(_losses(log))
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} tenplex {got[it]:.6f} (batch {sizes[it - 1]})"
                      for it in sorted(got))
    print(table)
    assert sorted(got) == sorted(ref)
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it], table)

    # the same checkpoint at DP2 with micro-batch 2: the batch of 6 from sample 14 does not split; refused at start
    log = _run(script, 1, 95, [*flags, "--load", str(ckpt), "--micro-batch-size", "2"], base=base, ok=False)
    assert (f"pretrain_gpt.py: with --tenplex, {schedule.flag}: the global batch of 6 (from consumed sample 14) is "
            f"not divisible by --micro-batch-size x DP = 2 x 2") in log, log[-3000:]
    assert log.count("the global batch of 6 (from consumed sample 14)") == 2, log[-3000:]  # both ranks
    assert "> tenplex: loaded" not in log and "AssertionError" not in log and not _log_lines(log), log[-3000:]
