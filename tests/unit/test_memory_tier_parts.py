"""Host-memory tier, the pure and local parts: the snapshot choice, the peer schedule, node ids, retention, cleaning."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch

from tenplex_megatron.cli import main as cli_main
from tenplex_megatron.errors import Failure
from tenplex_megatron.memory import mounts, node_dir
from tenplex_megatron.memory.helper import Helper
from tenplex_megatron.memory.protocol import (
    VERSION,
    Copy,
    Hurry,
    Persist,
    ProtocolError,
    Receive,
    Remove,
    Replicate,
    Reply,
    Send,
    decode_reply,
    decode_request,
    encode,
)
from tenplex_megatron.memory.shm_write import write_tensors
from tenplex_megatron.plan.peer_schedule import PeerKey, PeerRequest, merge_ranges, schedule
from tenplex_megatron.plan.restart_policy import DurableListing, ForeignSnapshotError, Snapshot
from tenplex_megatron.plan.restart_policy import pick_snapshot as choose
from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.safetensors_io import write_safetensors
from tests.logs import logged

FILES = {"rank_00000.safetensors": 100, "rank_00001.safetensors": 200}


def snap(node: str, it: int, present: dict[str, int], job: str = "job", digest: str = "d") -> Snapshot:
    return Snapshot(node, it, job, digest, FILES, present)


def test_newest_complete_snapshot_wins_and_an_incomplete_one_never() -> None:
    a0, a1 = {"rank_00000.safetensors": 100}, {"rank_00001.safetensors": 200}
    held = [snap("A", 4, FILES), snap("A", 6, a0), snap("B", 6, a1), snap("A", 8, a0)]  # 8: node B lost
    got = choose(held, "job", None)
    assert got is not None and got.iteration == 6
    assert got.holders == {"rank_00000.safetensors": ("A",), "rank_00001.safetensors": ("B",)}
    assert choose(held, "job", 7) is None  # the durable checkpoint is newer
    assert choose(held, "job", 6).iteration == 6  # a tie: memory, no read from durable storage
    truncated = [snap("A", 6, a0), snap("B", 6, {"rank_00001.safetensors": 199})]  # a short replica: no copy
    assert choose(truncated, "job", None) is None
    differ = [snap("A", 6, a0), snap("B", 6, a1, digest="other")]  # nodes disagree on the metadata
    assert choose(differ, "job", None) is None


def test_a_snapshot_incomplete_in_memory_is_completed_from_the_durable_checkpoint_of_its_iteration() -> None:
    a0 = {"rank_00000.safetensors": 100}
    held = [snap("A", 4, FILES), snap("A", 8, a0)]  # node B lost its memory, and with K=1 its file of 8
    whole = DurableListing(8, "d", dict(FILES))
    got = choose(held, "job", 8, whole)
    assert got is not None and got.iteration == 8 and got.durable == ("rank_00001.safetensors",)
    assert got.holders == {"rank_00000.safetensors": ("A",)}  # the memory first, the durable checkpoint last
    assert choose(held, "job", 8) is None  # without the listing: the durable load (as before)
    assert choose(held, "job", 8, DurableListing(8, "other", dict(FILES))) is None  # another snapshot
    short = DurableListing(8, "d", {"rank_00000.safetensors": 100, "rank_00001.safetensors": 199})
    assert choose(held, "job", 8, short) is None  # its copy of the missing file is not the recorded size
    older = DurableListing(4, "d", dict(FILES))  # the durable checkpoint is of another iteration
    assert choose(held, "job", 4, older).iteration == 4  # 8 cannot be completed: the older whole snapshot
    assert choose([snap("A", 8, FILES)], "job", 8, whole).durable == ()  # whole in memory: nothing durable


def test_another_jobs_snapshot_is_an_error_naming_it() -> None:
    with pytest.raises(ForeignSnapshotError, match="job 'other'.*never loaded"):
        choose([snap("A", 6, FILES, job="other")], "job", None)


def test_schedule_balances_senders_and_sends_each_range_once_per_receiver() -> None:
    f, g, h = PeerKey("f", "w"), PeerKey("g", "w"), PeerKey("h", "w")
    reqs = {2: [PeerRequest(f, 0, 100), PeerRequest(g, 0, 50)], 3: [PeerRequest(f, 0, 100)]}
    got = schedule(reqs, {f: [0, 1], g: [0, 1]})
    assert [(t.receiver, t.key) for t in got] == [(2, f), (2, g), (3, f)]
    assert {t.sender for t in got if t.key == f} == {0, 1}  # the second copy comes from the idle sender
    with pytest.raises(ValueError, match="h:w: no live rank holds it"):
        schedule({1: [PeerRequest(h, 0, 8)]}, {h: [1]})
    assert PeerRequest.from_json(PeerRequest(f, 3, 9).to_json()) == PeerRequest(f, 3, 9)  # what ranks gather
    assert merge_ranges([(8, 12), (0, 4), (4, 6), (20, 24)]) == [(0, 6), (8, 12), (20, 24)]


def test_node_id_is_made_once_and_kept(tmp_path) -> None:
    mem = str(tmp_path / "mem")
    first = node_dir.node_id(mem)
    assert node_dir.node_id(mem) == first and len(first) == 32
    with open(os.path.join(mem, node_dir.NODE_FILE), "w") as f:
        json.dump({"format": "something else"}, f)
    with pytest.raises(CheckpointFileError, match=node_dir.NODE_FILE):
        node_dir.node_id(mem)


def test_not_memory_backed_warns_naming_the_directory(tmp_path) -> None:
    if mounts.filesystem_type(str(tmp_path)) in mounts.MEMORY_FILESYSTEMS:
        pytest.skip("the temporary directory is on tmpfs here")
    with logged() as records:
        assert not mounts.warn_if_not_memory(str(tmp_path))
    assert [r.levelno for r in records] == [logging.WARNING]
    assert str(tmp_path) in records[0].getMessage() and "not memory-backed" in records[0].getMessage()
    if os.path.isdir("/dev/shm"):
        assert mounts.filesystem_type("/dev/shm") in mounts.MEMORY_FILESYSTEMS


MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24684092k 0 0
tmpfs /mnt/huge tmpfs rw,relatime,size=4g,huge=within_size 0 0
tmpfs /mnt/always tmpfs rw,size=4g,huge=always 0 0
tmpfs /mnt/huge/inner\\040dir tmpfs rw,relatime 0 0
"""


def test_huge_pages_hint_names_a_tmpfs_without_them() -> None:
    assert mounts.mount_of("/mnt/huge/job1", MOUNTS) == (
        "/mnt/huge", "tmpfs", ("rw", "relatime", "size=4g", "huge=within_size"))
    assert mounts.huge_pages_hint("/mnt/huge/job1", MOUNTS) is None
    assert mounts.huge_pages_hint("/mnt/always/x", MOUNTS) is None
    assert mounts.huge_pages_hint("/opt/ckpt", MOUNTS) is None  # not a tmpfs: warn_if_not_memory's case
    hint = mounts.huge_pages_hint("/dev/shm/job1", MOUNTS)
    assert hint is not None and "/dev/shm/job1" in hint and "huge=within_size" in hint
    inner = mounts.huge_pages_hint("/mnt/huge/inner dir/job", MOUNTS)  # the longest mount point wins
    assert inner is not None and "/mnt/huge/inner dir is a tmpfs" in inner


def test_huge_pages_hint_is_said_once_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    real = mounts.huge_pages_hint
    monkeypatch.setattr(mounts, "huge_pages_hint", lambda path: real(path, MOUNTS))  # the mounts above
    with logged() as records:
        monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's first rank: silent
        mounts.say_huge_pages_hint("/dev/shm/job1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        mounts.say_huge_pages_hint("/mnt/huge/job1")  # huge pages: nothing to say
        assert records == []
        mounts.say_huge_pages_hint("/dev/shm/job1")
    assert [(r.name, r.levelno) for r in records] == [("tenplex_megatron.memory", logging.INFO)]
    assert records[0].getMessage().startswith("--tenplex-memory /dev/shm/job1: /dev/shm is a tmpfs")


def _fake_snapshot(mem: str, it: int, **commit: Any) -> None:
    path = directory.prepare_partial(mem, it)
    with open(os.path.join(path, "rank_00000.safetensors"), "wb") as f:
        f.write(b"x" * 10)
    directory.commit(mem, it, {"format": directory.FORMAT_NAME, "format_version": 2, "iteration": it,
                               "files": {"rank_00000.safetensors": 10}}, {"rank_00000.safetensors": 10}, **commit)


def test_retention_protects_the_snapshot_being_persisted_and_clean_memory_removes_all(tmp_path, capsys) -> None:
    mem = str(tmp_path / "mem")
    node_dir.node_id(mem)
    for it in (1, 2, 3):
        _fake_snapshot(mem, it)
    assert [os.path.basename(p) for p in node_dir.retain(mem, 1, protect=(2,))] == ["iter_0000001"]
    assert directory.committed_iterations(mem) == [2, 3]
    assert [s.iteration for s in node_dir.list_snapshots(mem, "n")] == [2, 3]
    directory.prepare_partial(mem, 4)  # a snapshot killed half way
    os.makedirs(tmp_path / "mem" / "mine")  # not ours: left alone
    assert cli_main(["clean-memory", mem]) == 0
    assert "4 entries removed" in capsys.readouterr().out.splitlines()[-1]  # staging, 2, 3, the tracker
    assert sorted(os.listdir(mem)) == ["mine", node_dir.NODE_FILE]
    assert cli_main(["clean-memory", str(tmp_path)]) == 2  # not a memory directory: nothing removed


def _can_raise_priority() -> bool:
    """Whether this process holds CAP_SYS_NICE (bit 23 of its effective capabilities), which raising a helper out of
    the idle class takes."""
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(caps >> 23 & 1)


def test_persist_helper_copies_in_its_own_process_and_keeps_its_answer(tmp_path) -> None:
    src, dst = tmp_path / "a.bin", tmp_path / "out" / "a.bin"
    src.write_bytes(os.urandom(3 << 20))
    os.makedirs(dst.parent)
    helper = Helper()
    try:
        assert helper.proc.pid != os.getpid()
        helper.request(Remove((), 1))  # answered once the helper is up, its priority set
        assert helper.poll("remove", 1, 60.0) == Reply("remove", 1, 0)
        # a background citizen: the idle CPU class (a training thread that wakes takes the core at once), nice 19
        assert os.sched_getscheduler(helper.proc.pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, helper.proc.pid) == 19
        # while the job waits on it, at the job's priority (raising it takes CAP_SYS_NICE: else it stays put)
        helper.priority(waited_on=True)
        raised = _can_raise_priority()
        assert os.sched_getscheduler(helper.proc.pid) == (os.SCHED_OTHER if raised else os.SCHED_IDLE)
        assert os.getpriority(os.PRIO_PROCESS, helper.proc.pid) == (os.getpriority(os.PRIO_PROCESS, 0) if raised
                                                                   else 19)
        helper.priority(waited_on=False)
        assert os.sched_getscheduler(helper.proc.pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, helper.proc.pid) == 19
        helper.request(Persist(5, (Copy(str(src), str(dst)),)))
        got = None
        for _ in range(120):
            got = helper.poll("persist", 5, 0.5)
            if got is not None:
                break
        assert got is not None and got.ok and got.bytes == 3 << 20
        assert dst.read_bytes() == src.read_bytes()
        assert helper.poll("persist", 5) == got  # every node is polled until all answered: the answer stays
        helper.request(Persist(6, (Copy(str(tmp_path / "missing"), str(dst)),)))
        for _ in range(120):
            got = helper.poll("persist", 6, 0.5)
            if got is not None:
                break
        assert got is not None and not got.ok and "missing" in str(got.error)
        assert helper.proc.stdin is not None  # a line that is no request: refused with its name, the helper goes on
        helper.proc.stdin.write(b'{"format": "tenplex-memory-helper", "version": %d, "op": "explode", "iteration": 9}\n'
                                % VERSION)
        helper.proc.stdin.flush()
        refused = _answer(helper, "explode", 9)
        assert not refused.ok and "unknown op 'explode'" in str(refused.error) and helper.alive
    finally:
        helper.close()
    assert not helper.alive


def test_retired_snapshots_leave_the_listing_at_once_and_are_deleted_by_the_helper(tmp_path) -> None:
    mem = str(tmp_path / "mem")
    node_dir.node_id(mem)
    for it in (1, 2):
        _fake_snapshot(mem, it)
    handed: list[str] = []
    assert [os.path.basename(p) for p in node_dir.retain(mem, 1, dispose=handed.append)] == ["iter_0000001"]
    assert directory.committed_iterations(mem) == [2] and handed == node_dir.retired(mem)
    assert [os.path.basename(p) for p in handed] == ["iter_0000001" + directory.OLD_SUFFIX]
    _fake_snapshot(mem, 2, dispose=handed.append)  # the same iteration again: the replaced one is handed over too
    assert len(node_dir.retired(mem)) == 2
    helper = Helper()
    try:
        helper.request(Remove(tuple(node_dir.retired(mem))))
        got = None
        for _ in range(120):
            got = helper.poll("remove", 0, 0.5)
            if got is not None:
                break
        assert got is not None and got.ok and got.bytes == 2
    finally:
        helper.close()
    assert node_dir.retired(mem) == [] and directory.committed_iterations(mem) == [2]
    _fake_snapshot(mem, 3)
    node_dir.retain(mem, 1, dispose=lambda path: None)  # its deleter died: clean-memory removes it
    assert cli_main(["clean-memory", mem]) == 0 and node_dir.retired(mem) == []


def test_snapshot_file_is_the_safetensors_file_a_durable_save_writes_with_the_same_checksums(tmp_path) -> None:
    tensors = {"a": torch.randn(3, 1000), "b": torch.arange(7, dtype=torch.int64), "c": torch.empty(0),
               "d": torch.randn(300_001).to(torch.bfloat16)}
    size, sums = write_tensors(str(tmp_path / "m.safetensors"), tensors, 4096)
    ref_size, ref_sums = write_safetensors(str(tmp_path / "d.safetensors"), tensors, block_bytes=4096)
    assert (size, sums) == (ref_size, ref_sums)
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "d.safetensors").read_bytes()


def test_a_spare_file_is_written_over_and_truncated_to_the_same_bytes_as_a_fresh_write(tmp_path) -> None:
    """Reusing a retired snapshot's rank file (larger, other bytes) gives the file a fresh write gives."""
    tensors = {"a": torch.randn(3, 1000), "d": torch.randn(30_001).to(torch.bfloat16)}
    spare = tmp_path / "spare.safetensors"
    spare.write_bytes(os.urandom(400_000))
    inode = os.stat(spare).st_ino
    size, sums = write_tensors(str(spare), tensors, 4096, reuse=True)
    ref_size, ref_sums = write_tensors(str(tmp_path / "fresh.safetensors"), tensors, 4096)
    assert (size, sums) == (ref_size, ref_sums) and os.path.getsize(spare) == size
    assert spare.read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
    assert os.stat(spare).st_ino == inode  # the same file: its pages written over, not replaced


def test_retired_snapshots_leave_their_own_rank_files_as_spares_and_clean_memory_removes_them(tmp_path, capsys) -> None:
    mem = str(tmp_path / "mem")
    node_dir.node_id(mem)
    for it in (1, 2):
        _fake_snapshot(mem, it)
    retired: list[str] = []
    node_dir.retain(mem, 1, dispose=retired.append)
    old = retired[0]
    with open(os.path.join(old, "rank_00007.safetensors"), "wb") as f:  # a replica of another node's rank
        f.write(b"r" * 5)
    assert node_dir.keep_spares(old, mem, [0, 1]) == 1  # rank 0's file; rank 1 had none here
    assert sorted(os.listdir(old)) == sorted(["rank_00007.safetensors", directory.METADATA_FILE])  # left to delete
    assert open(node_dir.spare_path(mem, 0), "rb").read() == b"x" * 10
    assert node_dir.spare_bytes(mem, [0, 1]) == 10 and node_dir.spare_bytes(mem, [1]) == 0
    assert node_dir.list_snapshots(mem, "n")[-1].iteration == 2  # spares are never listed as a snapshot
    _fake_snapshot(mem, 3)
    node_dir.retain(mem, 1, dispose=retired.append)
    assert node_dir.keep_spares(retired[-1], mem, [0]) == 0  # rank 0's spare waits already: this one goes
    assert node_dir.drop_spares(mem, [0]) == []  # the node's own ranks' spares are kept
    assert [os.path.basename(p) for p in node_dir.drop_spares(mem, [3])] == ["rank_00000.safetensors"]
    os.replace(os.path.join(retired[-1], "rank_00000.safetensors"), node_dir.spare_path(mem, 0))
    assert cli_main(["clean-memory", mem]) == 0
    assert node_dir.SPARE_DIR not in os.listdir(mem)


def _answer(helper: Helper, op: str, it: int) -> Reply:
    for _ in range(240):
        got = helper.poll(op, it, 0.5)
        if got is not None:
            return got
    raise AssertionError(f"no answer to {op} {it}")


def test_auto_replication_rate_spreads_a_replication_over_part_of_the_snapshot_interval() -> None:
    from tenplex_megatron.memory.replication import replication_rate
    from tenplex_megatron.memory.settings import AUTO_PACE

    assert replication_rate(0.0, 0.0, 30.0, 10**9) == 0.0  # unlimited: all at once
    assert replication_rate(25.0, 0.0, 30.0, 10**9) == 25e6  # a cap alone
    assert replication_rate(0.0, AUTO_PACE, None, 10**9) == 0.0  # auto, first snapshot: no interval to pace by
    assert replication_rate(0.0, AUTO_PACE, 40.0, 10**9) == pytest.approx(10**9 / 20.0)  # 1 GB over 20 s
    assert replication_rate(25.0, AUTO_PACE, 40.0, 10**9) == 25e6  # the cap, where it is lower
    assert replication_rate(100.0, AUTO_PACE, 40.0, 10**9) == pytest.approx(50e6)  # the pace, where it is
    assert replication_rate(0.0, AUTO_PACE, 40.0, 0) > 0  # nothing to send: still cut in rounds, like the rest


def test_the_helpers_inbox_reads_without_blocking_and_takes_a_hurry_out_of_turn() -> None:
    from tenplex_megatron.memory.helper import Inbox, Refused

    r, w = os.pipe()
    try:
        box = Inbox(r)
        assert box.read(block=False) and box.queue == []  # nothing there: no wait
        persist = encode(Persist(2, ()))
        os.write(w, encode(Remove((), 1)) + encode(Hurry()) + persist[:20])
        assert box.read(block=False)
        assert box.hurry and box.queue == [Remove((), 1)]  # the partial line waits for its end
        os.write(w, persist[20:] + b'{"format": "tenplex-memory-helper", "version": %d, "op": "explode", "iteration": 3}\n'
                 % VERSION)
        os.close(w)
        w = -1
        got = list(box.requests())
        assert got[:2] == [Remove((), 1), Persist(2, ())]
        assert isinstance(got[2], Refused) and (got[2].op, got[2].iteration) == ("explode", 3)  # refused, not run
        assert "unknown op 'explode'" in got[2].reason
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_node_holds_its_own_ranks_and_those_it_keeps_replicas_of() -> None:
    """The ranks whose files a node keeps as spares: its own and the previous K-1 nodes' in the ring."""
    from tenplex_megatron.memory.settings import MemorySettings
    from tenplex_megatron.memory.state import MemoryTier

    nodes = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}

    def tier(node: str, replicas: int) -> MemoryTier:
        return MemoryTier(MemorySettings("m", "j", None, replicas=replicas), node=node, nodes=nodes)

    assert tier("b", 2).held_ranks() == [0, 1, 2, 3]  # K=2: a's replicas
    assert tier("a", 3).held_ranks() == [0, 1, 2, 3, 4, 5]
    assert tier("c", 1).held_ranks() == [4, 5] and not tier("c", 1).replicates and tier("c", 2).replicates


def test_snapshots_newer_than_the_restart_point_are_discarded(tmp_path) -> None:
    """A restart that went back to iteration 1 retires snapshots 2 and 3 (a timeline it left); from scratch, all."""
    mem = str(tmp_path / "mem")
    node_dir.node_id(mem)
    for it in (1, 2, 3):
        _fake_snapshot(mem, it)
    went: list[str] = []
    removed = node_dir.discard_newer(mem, 1, went.append)
    assert [os.path.basename(p) for p in removed] == ["iter_0000002", "iter_0000003"]
    assert [os.path.basename(p) for p in went] == ["iter_0000002.tenplex-old", "iter_0000003.tenplex-old"]
    assert directory.committed_iterations(mem) == [1] and node_dir.list_snapshots(mem, "n")[-1].iteration == 1
    assert node_dir.discard_newer(mem, 1, went.append) == []
    assert len(node_dir.discard_newer(mem, None, went.append)) == 1 and directory.committed_iterations(mem) == []


def test_a_fenced_jobs_helper_writes_nothing_more_into_the_durable_directory(tmp_path) -> None:
    """The helper persists for the lease generation the job holds on ``--save``: once another job has taken the
    directory over (a newer generation), its next persist is refused before any file, naming the newer holder."""
    save = tmp_path / "save"
    src, dst = tmp_path / "a.bin", save / "iter_0000005.tenplex-partial" / "a.bin"
    src.write_bytes(os.urandom(1 << 20))
    os.makedirs(dst.parent)
    leases, elsewhere = lease.LeaseSet(), lease.LeaseSet()  # this job's, and another job's process
    mine = leases.acquire(str(save), "job-a")
    helper = Helper()
    try:
        helper.request(Persist(5, (Copy(str(src), str(dst)),), (str(save), mine.generation)))
        got = _answer(helper, "persist", 5)
        assert got.ok and dst.read_bytes() == src.read_bytes()  # its own generation: written
        dst.unlink()
        newer = elsewhere.acquire(str(save), "job-b", take_over=True)  # another job takes the directory over
        assert newer.generation == mine.generation + 1
        helper.request(Persist(10, (Copy(str(src), str(dst)),), (str(save), mine.generation)))
        got = _answer(helper, "persist", 10)
        assert not got.ok and str(got.error).startswith("FencedError: ")
        assert got.error is not None and got.error.kind == lease.FencedError.kind  # the job tests the kind
        assert "a newer generation owns the directory" in str(got.error) and "job-b" in str(got.error)
        assert f"the memory helper of generation {mine.generation}" in str(got.error)
        assert not dst.exists()  # nothing written where the newer holder saves
    finally:
        helper.close()
        leases.close()
        elsewhere.close()


def test_helper_messages_are_versioned_json_and_a_bad_line_is_refused_naming_what_is_wrong() -> None:
    """Every request and reply survives its line; another version, an unknown op, a missing field are refused."""
    msgs = [Persist(5, (Copy("/m/a", "/d/a"),)), Persist(6, (), ("/d", 3)), Remove(("/m/old",), 0), Hurry(),
            Replicate(7, (Send("/m/f", 1, 3),), (Receive(1, 10, "/m/g", 2, None), Receive(0, 0, "/m/h", 4, "/s")), 2.5)]
    for m in msgs:
        assert decode_request(encode(m)) == m
    for reply in (Reply("persist", 5, 123), Reply("replicate", 7, error=Failure.of(OSError("gone")))):
        assert decode_reply(encode(reply)) == reply
    assert str(decode_reply(encode(Reply("replicate", 7, error=Failure.of(OSError("gone"))))).error) == "OSError: gone"
    line = json.loads(encode(Remove(("/x",), 1)))
    for bad, why in (({**line, "version": 1}, "version 1"), ({**line, "op": "explode"}, "unknown op 'explode'"),
                     ({k: v for k, v in line.items() if k != "paths"}, "'paths'"),
                     ({**line, "format": "other"}, "not a tenplex-memory-helper message")):
        with pytest.raises(ProtocolError, match=why):
            decode_request(json.dumps(bad))
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_request(b"[path, peer, tag]")
    words = {**json.loads(encode(Reply("persist", 5))), "error": "OSError: gone"}  # an error's words, no kind
    with pytest.raises(ProtocolError, match="field 'error' must be null or an object"):
        decode_reply(json.dumps(words))
