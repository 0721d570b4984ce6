"""The host-memory tier's gloo group (``memory/peers.py``'s ``cpu_group``) is the tier's: made when it opens, a new
one for the tier of the next world (an in-process restart), nothing to reset by hand. A one-rank gloo world in this process; the non-gloo case (an NCCL world) by reporting another backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tenplex_megatron.memory import peers, state
from tenplex_megatron.memory.settings import MemorySettings


def _world() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo world, destroyed afterwards (whatever the test left)."""
    _world()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_gloo_world_is_its_own_group(one_rank: None) -> None:
    assert peers.cpu_group() is dist.group.WORLD


def test_another_backend_gets_a_gloo_group_of_every_rank(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    group = peers.cpu_group()
    assert group is not dist.group.WORLD and group.size() == 1


def test_the_tier_keeps_its_group_and_the_next_worlds_tier_makes_its_own(one_rank: None, tmp_path) -> None:
    """The group is the tier's: made once when it opens, gone with it; a tier of the next world has the new one."""
    first = state.open_tier(MemorySettings(str(tmp_path / "mem"), str(tmp_path), None))
    assert first.group is dist.group.WORLD
    dist.destroy_process_group()  # the world ends (an in-process restart) and a new one begins
    _world()
    second = state.open_tier(MemorySettings(str(tmp_path / "mem"), str(tmp_path), None))
    assert second.group is dist.group.WORLD and second.group is not first.group
