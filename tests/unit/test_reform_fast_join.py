"""What keeps a planned re-form short (frontdoor/reform_runner.py, frontdoor/checkpointer.py): a newcomer does its
imports (``warm``) before it registers, never after (the running ranks stop for it at the next boundary), and one
refused for its flags does none; the boundary runs the front door's ``first`` once, after the world's first
iteration, and records when it decided the next world; the runner runs the front door's ``after`` once the world's
process group is gone; a Checkpointer made with ``helpers_at_open=False`` opens its host-memory tier without the
helpers and starts them when asked. Real torch stores, a one-rank gloo world, a real memory directory."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tenplex_megatron.frontdoor import reform_runner
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation
from tenplex_megatron.memory.settings import MemorySettings
from tests.unit.test_reform_runner import JOB, NAMES, started


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo world, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_newcomer_warms_before_it_registers_and_a_refused_one_never_does(monkeypatch: pytest.MonkeyPatch) -> None:
    m, gen = started(monkeypatch)
    seen: list[bool] = []  # at each warm: whether the running job already saw a registration
    other = reform_runner.job_flags(Namespace(**{**vars(JOB), "hidden_size": 128}), NAMES)
    with pytest.raises(SystemExit):
        reform_runner.first_generation(m, "h:8", other, warm=lambda: seen.append(m.pending(gen)))
    assert seen == []
    m.end()  # the job ends before admitting it: the newcomer's wait returns
    assert reform_runner.first_generation(m, "h:9", reform_runner.job_flags(JOB, NAMES),
                                          warm=lambda: seen.append(m.pending(gen))) is None
    assert seen == [False] and m.pending(gen)  # warmed unregistered, then registered


def test_the_boundary_runs_first_once_and_records_when_it_decided(one_rank: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    m, gen = started(monkeypatch)
    runs: list[int] = []
    b = reform_runner.Boundary(m, gen, lambda n: True, since={"boundary": 1.0, "torn_down": 2.0})
    b.first = lambda: runs.append(1)
    assert b() is False and b() is False
    assert runs == [1] and b.decided is None and b.since == {"boundary": 1.0, "torn_down": 2.0}
    m.register("h:9")
    assert b() is True and runs == [1]
    assert b.next is not None and b.next.members == ("h:0", "h:9") and b.decided is not None


@pytest.mark.parametrize("at_open", [True, False])
def test_the_memory_tiers_helpers_start_at_open_or_when_asked(one_rank: None, tmp_path, at_open: bool) -> None:
    memory = MemorySettings(str(tmp_path / "mem"), str(tmp_path / "ckpt"), None)
    ckpt = Checkpointer(JobConfig.for_api("pretrain_gpt.py", memory), helpers_at_open=at_open)
    try:
        tier = ckpt.memory()
        assert tier is not None and tier.helpers_started is at_open
        ckpt.start_background()
        assert tier.helpers_started
        ckpt.start_background()  # started once: nothing more
        assert tier.generation == 1
    finally:
        ckpt.close()


def test_the_front_doors_after_runs_once_the_worlds_process_group_is_destroyed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the front door leaves for after the world (its Checkpointer's close) runs after the last barrier and the
    process group's end, so that a node that leaves holds up no one there."""
    m, gen = started(monkeypatch)
    monkeypatch.setenv(REFORM_ENV, "run")
    seen: list[bool] = []  # at the front door's after: whether the world's process group still existed

    def one(g: Generation, store: object, b: reform_runner.Boundary) -> None:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        b.after = lambda: seen.append(dist.is_initialized())

    nxt, since = reform_runner.call(m, gen, "h:0", lambda n: True, one)
    assert seen == [False] and nxt is None and since == {}
