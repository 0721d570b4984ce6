"""The checkpoint directory's lease (storage/lease.py) with real files and real competing processes, and the job's
identity (storage/job_identity.py) read from a real TCPStore as torchrun's agents host one."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import pytest

from tenplex_megatron.frontdoor import lease_flags
from tenplex_megatron.frontdoor.job_config import JobConfig, LeaseConfig
from tenplex_megatron.storage import directory, job_identity, lease


def _claim(args: Namespace, leases: lease.LeaseSet) -> list[str]:
    """The trainers' start-up claim of the leases the flags in ``args`` name, into ``leases``."""
    return lease_flags.claim(JobConfig("pretrain_gpt.py", leases=LeaseConfig.from_args(args)), leases)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# another process: takes the lease of argv[1] for job argv[2] (ttl argv[3]), says its generation, then waits
HOLDER = """
import sys, time
from tenplex_megatron.storage import lease
held = lease.LeaseSet()
print(held.acquire(sys.argv[1], sys.argv[2], float(sys.argv[3])).generation, flush=True)
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 600)
"""


def _holder(d: str, job: str, ttl: float = 15.0, live: float = 600) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, d, job, str(ttl), str(live)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return p, int(p.stdout.readline())


@pytest.fixture
def leases():
    """This test's leases, as a job's Checkpointer holds them (released, the heartbeat ended, at the end)."""
    held = lease.LeaseSet()
    yield held
    held.close()


def _stage(save: str, it: int) -> None:
    """A staged save of iteration ``it`` (one rank file) ready to commit."""
    path = directory.prepare_partial(save, it)
    with open(os.path.join(path, directory.rank_file_name(0)), "wb") as f:
        f.write(b"x" * 8)


def _meta(it: int) -> dict:
    return {"format": directory.FORMAT_NAME, "format_version": directory.FORMAT_VERSION, "iteration": it,
            "files": {directory.rank_file_name(0): 8}}


def test_second_job_refused_naming_directory_and_holder(tmp_path, leases) -> None:
    d = str(tmp_path / "ckpt")
    p, gen = _holder(d, "job-a")
    try:
        with pytest.raises(lease.LeaseError) as e:
            leases.acquire(d, "job-b")
        assert d in str(e.value) and "job 'job-a'" in str(e.value) and f":{p.pid}" in str(e.value)
        assert "--tenplex-take-over" in str(e.value)
        with pytest.raises(lease.LeaseError) as e:  # the Python API's callers are told its argument, not a flag
            leases.acquire(d, "job-b", remedy=lease.API_REMEDY)
        assert "another save_dir" in str(e.value) and "take_over=True" in str(e.value)
        assert "--tenplex" not in str(e.value)
        assert lease.current(d).job == "job-a"  # nothing written by the refused job
        got = leases.acquire(d, "job-b", take_over=True)  # the flag: at once
        assert got.generation == gen + 1 and lease.current(d).job == "job-b"
    finally:
        p.kill()
        p.wait()


def test_same_job_takes_a_higher_generation_and_fences_the_older_writer(tmp_path, leases) -> None:
    """A split rendezvous: this process holds generation 1 with a save staged; another round of the same job takes
    generation 2. The older writer can neither commit, nor apply retention, nor remove partial saves."""
    save = str(tmp_path / "ckpt")
    mine = leases.acquire(save, "job")
    _stage(save, 3)
    directory.commit(save, 3, _meta(3), _meta(3)["files"], fence=leases.fence)  # the newest generation: commits
    _stage(save, 6)
    p, gen = _holder(save, "job")
    try:
        assert gen == mine.generation + 1
        fence = leases.fence  # the writer's fence, as its Checkpointer passes it down
        for what, act in (("commit", lambda: directory.commit(save, 6, _meta(6), _meta(6)["files"], fence=fence)),
                          ("retention", lambda: directory.apply_retention(save, 1, fence)),
                          ("clean-up", lambda: directory.remove_partial(directory.partial_dir(save, 6), fence))):
            with pytest.raises(lease.FencedError, match="a newer generation owns the directory"):
                act()
                pytest.fail(f"the older generation's {what} went through")
        assert directory.committed_iterations(save) == [3] and directory.partial_dirs(save)  # nothing touched
    finally:
        p.kill()
        p.wait()


def test_a_silent_holder_expires_and_a_dead_one_is_gone_at_once(tmp_path, leases) -> None:
    d = str(tmp_path / "ckpt")
    p, _ = _holder(d, "job-a", ttl=1.0)
    os.kill(p.pid, signal.SIGSTOP)  # alive but silent: its heartbeat stops
    try:
        time.sleep(0.3)
        with pytest.raises(lease.LeaseError):
            lease.check(d, "job-b")
        time.sleep(1.2)
        assert leases.acquire(d, "job-b").job == "job-b"  # expired: taken over
    finally:
        p.kill()
        p.wait()
    d2 = str(tmp_path / "ckpt2")
    p, _ = _holder(d2, "job-a", ttl=60.0)
    p.kill()
    p.wait()
    assert leases.acquire(d2, "job-b").job == "job-b"  # its holder died on this host: no wait


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


def test_released_lease_is_taken_at_once(tmp_path, leases) -> None:
    d = str(tmp_path / "ckpt")
    leases.acquire(d, "job-a", ttl=600)
    leases.release(d)
    assert lease.current(d).released
    with lease.LeaseSet() as other:  # another job's process
        assert other.acquire(d, "job-b").generation == 2


def test_the_heartbeat_thread_ends_once_no_lease_is_held_and_starts_again_with_the_next(tmp_path, leases) -> None:
    """A job closed in a process leaves no heartbeat thread of its leases; its next lease starts one (and is
    renewed). Another job's leases in the same process (a LeaseSet of its own) are not this one's to end."""
    import threading

    before = {t.ident for t in threading.enumerate() if t.name == "tenplex-lease-heartbeat"}

    def beating() -> list[threading.Thread]:  # this set's heartbeat threads
        return [t for t in threading.enumerate() if t.name == "tenplex-lease-heartbeat" and t.ident not in before]

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    leases.acquire(a, "job-a", ttl=0.5)
    assert len(beating()) == 1
    assert not leases.stop_heartbeat_when_idle()  # a lease is held: the heartbeat goes on
    leases.release(a)
    assert leases.stop_heartbeat_when_idle() and beating() == []
    first = leases.acquire(b, "job-b", ttl=0.5)
    assert len(beating()) == 1
    deadline = time.monotonic() + 30
    while leases.held(b).heartbeat == first.heartbeat and time.monotonic() < deadline:
        beating()[0].join(0.05)  # the new thread renews the lease (no fixed sleep: until it did, or 30 s)
    assert leases.held(b).heartbeat > first.heartbeat
    leases.release(b)
    assert leases.stop_heartbeat_when_idle() and beating() == []


def test_a_heartbeat_racing_a_release_does_not_mark_the_lease_live_again(tmp_path, leases) -> None:
    """The heartbeat lists the held leases, sleeps, then renews: a release in between must win (seen in CI: the two
    wrote one temporary file and the release's rename failed; a renewal after it would have undone it)."""
    d = str(tmp_path / "ckpt")
    leases.acquire(d, "job-a", ttl=600)
    with leases._lock:
        listed = list(leases._held.items())  # what the heartbeat thread holds while it sleeps
    leases.release(d)
    leases._beat_once(listed)
    assert lease.current(d).released
    assert not [f for f in os.listdir(lease.lease_dir(d)) if f.endswith(".tmp")]
    assert leases.acquire(d, "job-b").generation == 2  # taken at once
    leases.release(d)


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


def test_malformed_or_future_lease_file_refused_naming_it(tmp_path, leases) -> None:
    d = str(tmp_path / "ckpt")
    os.makedirs(lease.lease_dir(d))
    path = lease.gen_path(d, 1)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(lease.LeaseError, match=f"{path}: malformed lease file"):
        leases.acquire(d, "job")
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


def test_trainer_claim_refuses_before_any_process_group_and_names_the_holder(tmp_path, monkeypatch, leases) -> None:
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
            _claim(args, leases)
        args.tenplex_take_over = True
        assert _claim(args, leases) == [save] and lease.current(save).job == "job-b"
        leases.release(save)
        assert lease.current(save).released
    finally:
        p.kill()
        p.wait()


def test_a_filesystem_without_hard_links_is_refused_at_start(tmp_path, monkeypatch, leases) -> None:
    """The lease is taken by link(2): where the filesystem refuses it (EPERM, as vfat and some FUSE mounts do;
    injected here), the trainers stop at start naming the directory, and no lease generation is left behind."""
    save = str(tmp_path / "ckpt")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TENPLEX_FAULT", "lease.link:eperm")
    args = Namespace(tenplex=True, save=save, tenplex_memory=None, tenplex_job_id="job-a", tenplex_take_over=False,
                     tenplex_lease_ttl=15.0)
    with pytest.raises(SystemExit, match=f"pretrain_gpt.py: error: {save}: the filesystem refuses hard links"):
        _claim(args, leases)
    assert lease.generations(save) == [] and os.listdir(lease.lease_dir(save)) == []
    assert leases.held(save) is None


def _agent_store():
    """A TCPStore server as a torchrun agent hosts one (its workers see it at MASTER_ADDR:MASTER_PORT)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def _worker_env(store, rank: int, restart: int = 0, **more: str) -> dict[str, str]:
    """What torchrun's agent gives a worker of a launch without --rdzv-id (run id ``none``), with its store shared."""
    return {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart), **more}


def test_job_id_is_one_per_launch_the_same_on_every_rank_and_restart_round() -> None:
    """torchrun's default run id ``none`` is no identity: every rank of a launch, racing, and every later restart
    round of its agents read one token from the agents' store; another launch (another store) reads another."""
    a, b = _agent_store(), _agent_store()
    with ThreadPoolExecutor(4) as pool:  # four ranks of launch A at once, each its own client of the store
        first = set(pool.map(lambda r: job_identity.job_id(env=_worker_env(a, r)), range(4)))
    (ida,) = first
    assert ida.startswith("torchrun-") and ida != "torchrun-none"
    assert job_identity.job_id(env=_worker_env(a, 1, restart=1)) == ida  # the agents restarted the group
    assert job_identity.job_id(env=_worker_env(b, 0)) not in (ida, "none")  # another launch
    # what names a job first: the flag, a real run id (--rdzv-id, --standalone's uuid), the scheduler's job id
    assert job_identity.job_id("mine", env=_worker_env(a, 0)) == "mine"
    assert job_identity.job_id(env=_worker_env(a, 0, TORCHELASTIC_RUN_ID="rdzv")) == "rdzv"
    assert job_identity.job_id(env=_worker_env(a, 0, SLURM_JOB_ID="77")) == "slurm-77"
    # without torchrun: the master address of the launch, else this process
    assert job_identity.job_id(env={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "10.0.0.1:29500"
    assert job_identity.job_id(env={}) == f"{socket.gethostname()}:{os.getpid()}"


def test_run_id_none_without_a_shared_store_warns_and_an_unreachable_store_is_named(caplog) -> None:
    """Agents that share no store with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) leave nothing that names
    the launch: ``none``, with a warning saying what to pass; a store that cannot be reached is an error naming it."""
    with caplog.at_level(logging.WARNING, logger="tenplex_megatron"):
        env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29500", "RANK": "0"}
        assert job_identity.job_id(env=env) == "none"
    assert "--rdzv-id or --tenplex-job-id" in caplog.text
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(lease.LeaseError, match=f"torchrun's agent store at 127.0.0.1:{port}.*--tenplex-job-id"):
        job_identity.launch_token("127.0.0.1", port, timeout=0.5)


def test_claim_refuses_another_plain_torchrun_launch_and_lets_a_restart_round_take_the_next_generation(
        tmp_path, monkeypatch, leases) -> None:
    """The trainers' claim under two launches without --rdzv-id: while launch A's holder lives, launch B is refused
    naming the directory, the holder and --tenplex-take-over; a new round of A takes the next generation at once."""
    save = str(tmp_path / "ckpt")
    a, b = _agent_store(), _agent_store()
    ida = job_identity.job_id(env=_worker_env(a, 0))
    p, gen = _holder(save, ida)  # A's rank 0, alive
    try:
        args = Namespace(tenplex=True, save=save, tenplex_memory=None, tenplex_job_id=None, tenplex_take_over=False,
                         tenplex_lease_ttl=15.0)
        for k, v in _worker_env(b, 0).items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        with pytest.raises(SystemExit) as e:
            _claim(args, leases)
        assert f"{save} is held by job {ida!r}" in str(e.value) and f":{p.pid})" in str(e.value)
        assert "--tenplex-take-over" in str(e.value) and lease.current(save).generation == gen
        for k, v in _worker_env(a, 0, restart=1).items():
            monkeypatch.setenv(k, v)
        assert _claim(Namespace(**vars(args)), leases) == [save]
        assert lease.current(save).generation == gen + 1 and lease.current(save).job == ida
    finally:
        p.kill()
        p.wait()


def test_memory_directory_lease_is_claimed_by_the_nodes_first_rank(tmp_path, monkeypatch, leases) -> None:
    """--tenplex-memory: the node's first local rank takes the memory directory's lease; the node's other ranks only
    check it; another job is refused there too."""


    mem, save = str(tmp_path / "mem"), str(tmp_path / "ckpt")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = Namespace(tenplex=True, save=save, tenplex_memory=mem, tenplex_job_id="job-a", tenplex_take_over=False,
                     tenplex_lease_ttl=15.0)
    assert _claim(args, leases) == [mem]  # rank 1: not --save's; local rank 0: the memory's
    assert lease.current(mem).job == "job-a" and lease.current(save) is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    other = Namespace(**{**vars(args), "tenplex_job_id": "job-b", "save": str(tmp_path / "other")})
    with lease.LeaseSet() as elsewhere, pytest.raises(SystemExit, match=f"{mem} is held by job 'job-a'"):
        _claim(other, elsewhere)  # another process, of another job, on the same node


def test_a_fifo_or_giant_in_place_of_a_lease_file_is_refused_naming_it_without_blocking(tmp_path, leases) -> None:
    """A lease file is read like a checkpoint's own small files: a FIFO (which a plain open would wait on forever)
    and a sparse giant are refused, naming the file, before anything is written."""
    d = str(tmp_path / "ckpt")
    os.makedirs(lease.lease_dir(d))
    path = lease.gen_path(d, 1)
    os.mkfifo(path)
    with pytest.raises(lease.LeaseError, match=f"{path}: is a FIFO"):
        lease.check(d, "job")
    os.remove(path)
    with open(path, "w") as f:
        f.truncate(10 * lease.LEASE_MAX_BYTES)
    with pytest.raises(lease.LeaseError, match=f"{path}: .* over the cap"):
        leases.acquire(d, "job")
    assert lease.generations(d) == [1]  # nothing taken


def test_adopted_generation_is_kept_by_the_adopter_when_the_taker_dies_and_fenced_by_a_newer_one(tmp_path, leases) -> None:
    """A job continuing in place: one process takes a generation in a longer-lived process's name (``holder_pid``),
    another adopts it (no new generation); the taker dies and the lease stays live and the adopter's (renewed by
    its heartbeat, never fenced); another job's newer generation fences the adopter, and adopting it is refused."""
    d, parent = str(tmp_path / "ckpt"), os.getpid()
    assert leases.stop_heartbeat_when_idle()  # an earlier test's heartbeat thread, asleep for its period, ended
    taker = subprocess.Popen([sys.executable, "-c", "import sys; from tenplex_megatron.storage import lease; "
                              "g = lease.LeaseSet().acquire(sys.argv[1], 'job-a', 0.5, holder_pid=int(sys.argv[2])); "
                              "print(g.generation, g.token, flush=True)", d, str(parent)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    gen, token = taker.stdout.readline().split()
    assert taker.wait(timeout=60) == 0  # the taker is gone; the lease names this (living) process as its holder
    mine = leases.adopt(d, int(gen), token)
    assert mine.holder == f"{socket.gethostname()}:{parent}" and lease.generations(d) == [int(gen)]
    time.sleep(1.5)  # three ttls: only the adopter's heartbeat keeps it live
    assert not lease.current(d).gone(time.time()) and lease.current(d).heartbeat > mine.heartbeat
    with pytest.raises(lease.LeaseError, match="held by job 'job-a'"):
        lease.check(d, "job-b")
    leases.fence(d)  # still the newest: the adopter writes on
    other = subprocess.run([sys.executable, "-c", "import sys; from tenplex_megatron.storage import lease; "
                            "print(lease.LeaseSet().acquire(sys.argv[1], 'job-b', take_over=True).generation)", d],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    newer = int(other.stdout)  # another job took the directory over
    with pytest.raises(lease.FencedError, match="a newer generation owns the directory"):
        leases.fence(d)
    with pytest.raises(lease.FencedError, match=f"generation {newer}; this job took generation {gen}"):
        leases.adopt(d, int(gen), token)
    leases.release(d)
    assert leases.stop_heartbeat_when_idle()
