"""``--async-save`` with ``--tenplex``: a save returns once the state is captured in host memory (the tier, in
/dev/shm by default) and a helper process writes it to ``--save`` in the background, committed before the next save
and at exit; a job restarted at another layout from those durable checkpoints (the node's memory gone) continues
the uninterrupted run's losses."""

from __future__ import annotations

import shutil

import pytest

from tenplex_megatron.frontdoor.memory_flags import async_save_dir
from tenplex_megatron.storage.directory import committed_iterations
from tests.harness import TINY_GPT, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist


def test_async_saves_are_written_in_the_background_and_resume_at_another_layout(tmp_path) -> None:
    save = str(tmp_path / "ckpt")
    ref, first, resumed = (str(tmp_path / f"{n}.jsonl") for n in ("ref", "first", "resumed"))
    common = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "6"]
    mem = async_save_dir(save)
    try:
        r = torchrun(2, [*common, *layout_flags(2, 1), "--tenplex-metrics", ref])
        assert r.returncode == 0, r.log[-4000:]
        r = torchrun(2, [*common, *layout_flags(2, 1), "--save", save, "--save-interval", "2", "--exit-interval", "4",
                         "--async-save", "--tenplex-metrics", first])
        assert r.returncode == 0, r.log[-4000:]
        assert "persisting in the background" in r.log and f"host memory {mem}" in r.log, r.log[-4000:]
        assert committed_iterations(save) == [2, 4]  # both written by the helper, committed by the job
        shutil.rmtree(mem)  # the node's memory is gone: the restart reads the durable checkpoint
        r = torchrun(2, [*common, *layout_flags(1, 1), "--load", save, "--tenplex-metrics", resumed])
        assert r.returncode == 0, r.log[-4000:]
        assert f"loaded iteration 4 from {save}/iter_0000004" in r.log, r.log[-4000:]
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    a = {m["iteration"]: m["loss"] for m in metrics(ref)}
    got = {m["iteration"]: m["loss"] for m in [*metrics(first), *metrics(resumed)]}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for it, loss in got.items():
        assert loss == pytest.approx(a[it], rel=2e-6), (it, loss, a[it])
