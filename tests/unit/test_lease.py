"""The checkpoint directory's lease (storage/lease.py) with real files and real competing processes, no torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from tenplex_megatron.frontdoor import lease_flags
from tenplex_megatron.storage import directory, lease

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# another process: takes the lease of argv[1] for job argv[2] (ttl argv[3]), says its generation, then waits
HOLDER = """
import sys, time
from tenplex_megatron.storage import lease
print(lease.acquire(sys.argv[1], sys.argv[2], float(sys.argv[3])).generation, flush=True)
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 600)
"""


def _holder(d: str, job: str, ttl: float = 15.0, live: float = 600) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, d, job, str(ttl), str(live)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return p, int(p.stdout.readline())


@pytest.fixture(autouse=True)
def _forget_held():
    yield
    lease._HELD.clear()


def _stage(save: str, it: int) -> None:
    """A staged save of iteration ``it`` (one rank file) ready to commit."""
    path = directory.prepare_partial(save, it)
    with open(os.path.join(path, directory.rank_file_name(0)), "wb") as f:
        f.write(b"x" * 8)


def _meta(it: int) -> dict:
    return {"format": directory.FORMAT_NAME, "format_version": directory.FORMAT_VERSION, "iteration": it,
            "files": {directory.rank_file_name(0): 8}}


def test_second_job_refused_naming_directory_and_holder(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    p, gen = _holder(d, "job-a")
    try:
        with pytest.raises(lease.LeaseError) as e:
            lease.acquire(d, "job-b")
        assert d in str(e.value) and "job 'job-a'" in str(e.value) and f":{p.pid}" in str(e.value)
        assert "--tenplex-take-over" in str(e.value)
        with pytest.raises(lease.LeaseError) as e:  # the Python API's callers are told its argument, not a flag
            lease.acquire(d, "job-b", remedy=lease.API_REMEDY)
        assert "another save_dir" in str(e.value) and "take_over=True" in str(e.value)
        assert "--tenplex" not in str(e.value)
        assert lease.current(d).job == "job-a"  # nothing written by the refused job
        got = lease.acquire(d, "job-b", take_over=True)  # the flag: at once
        assert got.generation == gen + 1 and lease.current(d).job == "job-b"
    finally:
        p.kill()
        p.wait()


def test_same_job_takes_a_higher_generation_and_fences_the_older_writer(tmp_path) -> None:
    """A split rendezvous: this process holds generation 1 with a save staged; another round of the same job takes
    generation 2. The older writer can neither commit, nor apply retention, nor remove partial saves."""
    save = str(tmp_path / "ckpt")
    mine = lease.acquire(save, "job")
    _stage(save, 3)
    directory.commit(save, 3, _meta(3), _meta(3)["files"])  # the newest generation: commits
    _stage(save, 6)
    p, gen = _holder(save, "job")
    try:
        assert gen == mine.generation + 1
        for what, act in (("commit", lambda: directory.commit(save, 6, _meta(6), _meta(6)["files"])),
                          ("retention", lambda: directory.apply_retention(save, 1)),
                          ("clean-up", lambda: directory.remove_partial(directory.partial_dir(save, 6)))):
            with pytest.raises(lease.FencedError, match="a newer generation owns the directory"):
                act()
                pytest.fail(f"the older generation's {what} went through")
        assert directory.committed_iterations(save) == [3] and directory.partial_dirs(save)  # nothing touched
    finally:
        p.kill()
        p.wait()


def test_a_silent_holder_expires_and_a_dead_one_is_gone_at_once(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    p, _ = _holder(d, "job-a", ttl=1.0)
    os.kill(p.pid, signal.SIGSTOP)  # alive but silent: its heartbeat stops
    try:
        time.sleep(0.3)
        with pytest.raises(lease.LeaseError):
            lease.check(d, "job-b")
        time.sleep(1.2)
        assert lease.acquire(d, "job-b").job == "job-b"  # expired: taken over
    finally:
        p.kill()
        p.wait()
    d2 = str(tmp_path / "ckpt2")
    p, _ = _holder(d2, "job-a", ttl=60.0)
    p.kill()
    p.wait()
    assert lease.acquire(d2, "job-b").job == "job-b"  # its holder died on this host: no wait


def test_heartbeat_keeps_a_live_lease(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    p, _ = _holder(d, "job-a", ttl=0.5)
    try:
        time.sleep(1.5)  # three ttls: renewed meanwhile
        with pytest.raises(lease.LeaseError):
            lease.check(d, "job-b")
    finally:
        p.kill()
        p.wait()


def test_released_lease_is_taken_at_once(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    lease.acquire(d, "job-a", ttl=600)
    lease.release(d)
    assert lease.current(d).released
    lease._HELD.clear()
    assert lease.acquire(d, "job-b").generation == 2


def test_the_heartbeat_thread_ends_once_no_lease_is_held_and_starts_again_with_the_next(tmp_path) -> None:
    """A job closed in a process leaves no heartbeat thread; the next job's lease starts one (and is renewed)."""
    import threading

    def beating() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "tenplex-lease-heartbeat"]

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    lease._HELD.clear()
    lease.acquire(a, "job-a", ttl=0.5)
    assert beating()
    assert not lease.stop_heartbeat_when_idle()  # a lease is held: the heartbeat goes on
    lease.release(a)
    assert lease.stop_heartbeat_when_idle() and beating() == []
    first = lease.acquire(b, "job-b", ttl=0.5)
    assert len(beating()) == 1
    deadline = time.monotonic() + 30
    while lease.held(b).heartbeat == first.heartbeat and time.monotonic() < deadline:
        beating()[0].join(0.05)  # the new thread renews the lease (no fixed sleep: until it did, or 30 s)
    assert lease.held(b).heartbeat > first.heartbeat
    lease.release(b)
    assert lease.stop_heartbeat_when_idle() and beating() == []


def test_a_heartbeat_racing_a_release_does_not_mark_the_lease_live_again(tmp_path) -> None:
    """The heartbeat lists the held leases, sleeps, then renews: a release in between must win (seen in CI: the two
    wrote one temporary file and the release's rename failed; a renewal after it would have undone it)."""
    d = str(tmp_path / "ckpt")
    lease.acquire(d, "job-a", ttl=600)
    with lease._LOCK:
        listed = list(lease._HELD.items())  # what the heartbeat thread holds while it sleeps
    lease.release(d)
    lease._beat_once(listed)
    assert lease.current(d).released
    assert not [f for f in os.listdir(lease.lease_dir(d)) if f.endswith(".tmp")]
    assert lease.acquire(d, "job-b").generation == 2  # taken at once
    lease.release(d)


def test_racing_rounds_get_distinct_generations_one_owner(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    procs = [_holder(d, "job") for _ in range(4)]
    try:
        gens = sorted(g for _, g in procs)
        assert gens == list(range(gens[0], gens[0] + 4))
        assert lease.current(d).generation == gens[-1]
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_malformed_or_future_lease_file_refused_naming_it(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    os.makedirs(lease.lease_dir(d))
    path = lease.gen_path(d, 1)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(lease.LeaseError, match=f"{path}: malformed lease file"):
        lease.acquire(d, "job")
    with open(path, "w") as f:
        json.dump({"format": lease.FORMAT, "version": lease.VERSION + 1, "job": "x"}, f)
    with pytest.raises(lease.LeaseError, match=f"{path}: lease format version 2"):
        lease.check(d, "job")


def test_no_lease_no_fence(tmp_path) -> None:
    """A process holding no lease on a directory (a library user's save, a CLI clean-up) is not fenced."""
    save = str(tmp_path / "ckpt")
    _stage(save, 1)
    directory.commit(save, 1, _meta(1), _meta(1)["files"])
    assert directory.committed_iterations(save) == [1]


def test_trainer_claim_refuses_before_any_process_group_and_names_the_holder(tmp_path, monkeypatch) -> None:
    """frontdoor/lease_flags.claim (both trainers' start-up): rank 0 takes --save's lease, another job is refused
    with SystemExit naming the directory and the holder; --tenplex-take-over takes it."""
    save = str(tmp_path / "ckpt")
    p, _ = _holder(save, "job-a")
    try:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        args = Namespace(tenplex=True, save=save, tenplex_memory=None, tenplex_job_id="job-b",
                         tenplex_take_over=False, tenplex_lease_ttl=15.0)
        with pytest.raises(SystemExit, match=f"pretrain_gpt.py: error: {save} is held by job 'job-a'"):
            lease_flags.claim(args, "pretrain_gpt.py")
        args.tenplex_take_over = True
        assert lease_flags.claim(args, "pretrain_gpt.py") == [save] and lease.current(save).job == "job-b"
        lease_flags.release(args)
        assert lease.current(save).released
    finally:
        p.kill()
        p.wait()


def test_a_filesystem_without_hard_links_is_refused_at_start(tmp_path, monkeypatch) -> None:
    """The lease is taken by link(2): where the filesystem refuses it (EPERM, as vfat and some FUSE mounts do;
    injected here), the trainers stop at start naming the directory, and no lease generation is left behind."""
    save = str(tmp_path / "ckpt")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TENPLEX_FAULT", "lease.link:eperm")
    args = Namespace(tenplex=True, save=save, tenplex_memory=None, tenplex_job_id="job-a", tenplex_take_over=False,
                     tenplex_lease_ttl=15.0)
    with pytest.raises(SystemExit, match=f"pretrain_gpt.py: error: {save}: the filesystem refuses hard links"):
        lease_flags.claim(args, "pretrain_gpt.py")
    assert lease.generations(save) == [] and os.listdir(lease.lease_dir(save)) == []
    assert lease.held(save) is None


def test_job_id_is_the_same_on_every_rank_of_a_launch(monkeypatch) -> None:


    for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    args = Namespace(tenplex_job_id=None)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert lease_flags.job_id(args) == "10.0.0.1:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert lease_flags.job_id(args) == "slurm-77"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv")
    assert lease_flags.job_id(args) == "rdzv"
    assert lease_flags.job_id(Namespace(tenplex_job_id="mine")) == "mine"


def test_memory_directory_lease_is_claimed_by_the_nodes_first_rank(tmp_path, monkeypatch) -> None:
    """--tenplex-memory: the node's first local rank takes the memory directory's lease; the node's other ranks only
    check it; another job is refused there too."""


    mem, save = str(tmp_path / "mem"), str(tmp_path / "ckpt")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = Namespace(tenplex=True, save=save, tenplex_memory=mem, tenplex_job_id="job-a", tenplex_take_over=False,
                     tenplex_lease_ttl=15.0)
    assert lease_flags.claim(args, "pretrain_gpt.py") == [mem]  # rank 1: not --save's; local rank 0: the memory's
    assert lease.current(mem).job == "job-a" and lease.current(save) is None
    lease._HELD.clear()  # another process, of another job, on the same node
    monkeypatch.setenv("LOCAL_RANK", "1")
    other = Namespace(**{**vars(args), "tenplex_job_id": "job-b", "save": str(tmp_path / "other")})
    del other.tenplex_leases
    with pytest.raises(SystemExit, match=f"{mem} is held by job 'job-a'"):
        lease_flags.claim(other, "pretrain_gpt.py")
