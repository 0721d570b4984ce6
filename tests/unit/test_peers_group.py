"""The host-memory tier's gloo group (``memory/peers.py``'s ``cpu_group``) lives with the world it was made in: one
per world, found again while the world lasts, a new one in the next world (an in-process restart), nothing to reset
by hand. A one-rank gloo world in this process; the non-gloo case (an NCCL world) by reporting another backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tenplex_megatron.memory import peers


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


def test_another_backend_gets_one_gloo_group_per_world(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    first = peers.cpu_group()
    assert first is not dist.group.WORLD and first.size() == 1
    assert peers.cpu_group() is first  # found again, not made again
    dist.destroy_process_group()  # the world ends (an in-process restart) and a new one begins
    _world()
    second = peers.cpu_group()
    assert second is not first and peers.cpu_group() is second
