"""The planned re-form's membership protocol (frontdoor/membership.py) on real torch stores: newcomers register,
ranks leave on notice, rank 0 proposes the next world (dense ranks, a new generation), a world without a legal
layout is refused with the registrations kept pending, newcomers wait for the generation that names them."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tenplex_megatron import TenplexError
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, MembershipError, member_id


def first(m: Membership, n: int = 2) -> Generation:
    gen = Generation(0, tuple(f"h:{i}" for i in range(n)))
    m.publish(gen)
    return gen


def test_nothing_pending_until_a_newcomer_registers() -> None:
    m = Membership(dist.HashStore())
    gen = first(m)
    assert not m.pending(gen)
    assert m.register("h:9") == 1
    assert m.pending(gen)


def test_newcomers_join_after_the_running_ranks_numbered_densely() -> None:
    m = Membership(dist.HashStore())
    gen = first(m)
    m.register("h:7")
    m.register("h:8")
    nxt = m.propose(gen, lambda n: True)
    assert nxt.number == 1 and nxt.members == ("h:0", "h:1", "h:7", "h:8")
    assert [nxt.rank(x) for x in nxt.members] == [0, 1, 2, 3] and nxt.rank("h:5") is None
    assert not m.pending(nxt)
    m.publish(nxt)
    assert m.generation(1) == nxt


def test_a_leave_notice_removes_its_members_and_the_rest_renumber() -> None:
    m = Membership(dist.HashStore())
    gen = Generation(3, ("h:0", "h:1", "h:2", "h:3"), joins=2, changes=2)
    m.store.add("tenplex-members/joins", 2)
    m.store.add("tenplex-members/changes", 2)
    assert not m.pending(gen)
    m.notice_leave(["h:1", "h:2"])
    nxt = m.propose(gen, lambda n: True)
    assert nxt.number == 4 and nxt.members == ("h:0", "h:3") and nxt.rank("h:3") == 1
    assert (nxt.joins, nxt.leaves) == (2, 1)


def test_a_world_without_a_legal_layout_is_refused_and_the_newcomer_stays_pending() -> None:
    m = Membership(dist.HashStore())
    gen = first(m)
    m.register("h:7")  # 3 ranks: not legal here
    kept = m.propose(gen, lambda n: n % 2 == 0)
    assert kept.number == 0 and kept.members == gen.members and kept.joins == 0
    assert not m.pending(kept)  # seen: not checked again every iteration
    m.register("h:8")  # 4: legal, and the first newcomer is still in
    nxt = m.propose(kept, lambda n: n % 2 == 0)
    assert nxt.number == 1 and nxt.members == ("h:0", "h:1", "h:7", "h:8")


def test_no_change_left_after_a_newcomer_leaves_before_joining() -> None:
    m = Membership(dist.HashStore())
    gen = first(m)
    m.register("h:7")
    m.notice_leave(["h:7"])
    same = m.propose(gen, lambda n: True)
    assert same.number == 0 and same.members == gen.members and not m.pending(same)


def test_a_newcomer_waits_for_the_generation_that_names_it_over_tcp() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))
    running, newcomer = Membership(server, timeout=5), Membership(client, timeout=5)
    gen = first(running)
    got: list[Generation | None] = []
    t = threading.Thread(target=lambda: got.append(newcomer.admitted("h:7")))
    t.start()
    newcomer.register("h:7")
    other = running.propose(gen, lambda n: n != 3)  # refused: the newcomer keeps waiting
    assert other.number == 0
    running.publish(Generation(1, ("h:0",), changes=other.changes))  # a generation without it is skipped
    newcomer.register("h:8")
    nxt = running.propose(Generation(1, ("h:0",), changes=other.changes), lambda n: n != 2)
    running.publish(nxt)
    t.join(timeout=10)
    assert got == [nxt] and nxt.members == ("h:0", "h:7", "h:8")


def test_a_newcomer_stops_waiting_when_the_job_is_over() -> None:
    m = Membership(dist.HashStore())
    first(m)
    m.end()
    assert m.admitted("h:7") is None


def test_a_key_that_never_comes_is_a_tenplex_error() -> None:
    m = Membership(dist.HashStore(), timeout=0.2)
    with pytest.raises(MembershipError, match="tenplex-members/gen/5") as e:
        m.generation(5)
    assert isinstance(e.value, TenplexError)
    with pytest.raises(MembershipError, match="malformed"):
        Generation.from_json("{}")


def test_the_initial_ranks_make_generation_zero_in_rank_order() -> None:
    m = Membership(dist.HashStore(), timeout=5)
    got: list[Generation] = []
    t = threading.Thread(target=lambda: got.append(m.start("h:1", 1, 2)))
    t.start()
    gen = m.start("h:0", 0, 2)
    t.join(timeout=10)
    assert got == [gen] and gen == Generation(0, ("h:0", "h:1"))


def test_member_ids_name_host_and_pid() -> None:
    assert member_id(12, "node-a") == "node-a:12" and member_id().endswith(":" + str(__import__("os").getpid()))


def test_the_launchers_reform_and_join_flags_reach_the_ranks() -> None:
    from tenplex_megatron.frontdoor import launch

    plain = launch.rank_env(launch.parse(["--nproc-per-node", "2", "x.py"]), 0)
    assert REFORM_ENV not in plain
    run = launch.parse(["--reform", "--nproc-per-node", "2", "x.py"])
    assert launch.rank_env(run, 1)[REFORM_ENV] == "run"
    join = launch.parse(["--join", "--node-rank", "1", "--master-addr", "10.0.0.1", "--nproc-per-node", "2", "x.py"])
    env = launch.rank_env(join, 0)
    assert join.reform and env[REFORM_ENV] == "join" and env["TENPLEX_INPROCESS_STORE"] == "10.0.0.1:29500"


def test_a_reform_without_the_stores_or_host_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    from tenplex_megatron.training import reform

    ok = Namespace(tenplex=True, tenplex_memory="/dev/shm/m", tenplex_inprocess=False)
    monkeypatch.delenv("TENPLEX_INPROCESS_STORE", raising=False)
    assert "--reform" in (reform.refusal(ok) or "")
    monkeypatch.setenv("TENPLEX_INPROCESS_STORE", "127.0.0.1:29500")
    assert reform.refusal(ok) is None
    assert "--tenplex-memory" in (reform.refusal(Namespace(**{**vars(ok), "tenplex_memory": None})) or "")
    assert "give one" in (reform.refusal(Namespace(**{**vars(ok), "tenplex_inprocess": True})) or "")


def test_a_newcomer_whose_job_store_went_away_gets_a_tenplex_error() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=2), wait_for_workers=False)
    client = Membership(dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=2)))
    del server
    with pytest.raises(MembershipError, match="went away"):
        client.admitted("h:7")
