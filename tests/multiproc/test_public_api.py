"""The README's public API example (examples/own_loop.py): a plain megatron-core loop saved at TP2 with
``tenplex_megatron.save_checkpoint`` resumes at TP1 x DP2 with ``tenplex_megatron.load_checkpoint`` and its
losses continue the uninterrupted run's; the API's lease and its fallback past a damaged newest checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import ROOT, flip, metrics, torchrun

pytestmark = pytest.mark.dist
EXAMPLE = os.path.join(ROOT, "examples", "own_loop.py")
# another job's process: holds the lease of argv[1] and says its generation, until killed
HOLDER = """
import sys, time
from tenplex_megatron.storage import lease
held = lease.LeaseSet()
print(held.acquire(sys.argv[1], "another-job").generation, flush=True)
time.sleep(600)
"""


def test_own_loop_resumes_at_another_layout(tmp_path) -> None:
    ckpt, ref, resumed = str(tmp_path / "ckpt"), str(tmp_path / "ref.jsonl"), str(tmp_path / "resumed.jsonl")
    r = torchrun(2, ["--tp", "2", "--iters", "6", "--save-interval", "3", "--dir", ckpt, "--metrics", ref],
                 script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    os.replace(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), os.path.join(ckpt, "tracker.bak"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from iteration 3, not the final save at 6
    r = torchrun(2, ["--tp", "1", "--iters", "6", "--dir", ckpt, "--metrics", resumed], script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    a = {m["iteration"]: m["loss"] for m in metrics(ref)}
    b = metrics(resumed)
    assert [m["iteration"] for m in b] == [4, 5, 6]
    for m in b:
        assert m["loss"] == pytest.approx(a[m["iteration"]], rel=2e-6), (m, a)
    assert f"resumed at iteration 3 from tp=2,pp=1,dp=1 (loss then: {a[3]!r})" in r.log, r.log[-4000:]  # .extra, .layout


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_naming_the_file(tmp_path) -> None:
    """load_checkpoint goes through the Checkpointer's resume sequence: the newest checkpoint's rank file damaged
    (one byte of a tensor flipped), the load falls back to the previous complete one, naming the file, and the
    losses from there continue the uninterrupted run's."""
    ckpt, ref, resumed = str(tmp_path / "ckpt"), str(tmp_path / "ref.jsonl"), str(tmp_path / "resumed.jsonl")
    r = torchrun(2, ["--tp", "2", "--iters", "6", "--save-interval", "3", "--dir", ckpt, "--metrics", ref],
                 script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    damaged = os.path.join(ckpt, "iter_0000006", "rank_00001.safetensors")
    flip(damaged)
    r = torchrun(2, ["--tp", "1", "--iters", "6", "--dir", ckpt, "--metrics", resumed], script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    assert "skipping a damaged copy" in r.log and damaged in r.log, r.log[-4000:]
    a = {m["iteration"]: m["loss"] for m in metrics(ref)}
    b = metrics(resumed)
    assert [m["iteration"] for m in b] == [4, 5, 6]
    for m in b:
        assert m["loss"] == pytest.approx(a[m["iteration"]], rel=2e-6), (m, a)


def test_a_directory_another_live_job_holds_is_refused_before_anything_is_written(tmp_path) -> None:
    """save_checkpoint claims its directory's lease: another live job's directory is refused on every rank, naming
    the directory, the holder and the API's remedy, and nothing is written there."""
    ckpt = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, ckpt], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert int(holder.stdout.readline()) == 1
        r = torchrun(2, ["--tp", "2", "--iters", "1", "--save-interval", "1", "--dir", ckpt], script=EXAMPLE)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    assert f"{ckpt} is held by job 'another-job'" in r.log and "take_over=True" in r.log, r.log[-4000:]
    assert sorted(os.listdir(ckpt)) == ["tenplex-lease"]
