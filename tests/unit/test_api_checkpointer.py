"""The Checkpointer behind the DeepSpeed calls (``Checkpointer.for_api``): a loop's ``checkpointer=`` claims each save
directory at its first save and holds the lease until it is closed; without one, each call claims and releases at its
end. Real lease files, one process (world of one); the save itself is stood in for (no DeepSpeed engine here)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.frontdoor import deepspeed as tds
from tenplex_megatron.frontdoor.checkpointer import Checkpointer, CheckpointerClosedError
from tenplex_megatron.storage import lease


@pytest.fixture
def saves(monkeypatch) -> list[tuple[str, Any]]:
    """Each save the calls reach, with the lease of its directory as it was then (nothing is written)."""
    seen: list[tuple[str, Any]] = []

    def save(adapter: Any, save_dir: str, keep: Any = None, fence: Any = None) -> str:
        seen.append((save_dir, lease.current(save_dir)))
        return f"saved {save_dir}"

    monkeypatch.setattr(tds, "save", save)
    return seen


def test_a_loops_checkpointer_claims_once_and_holds_the_lease_until_closed(tmp_path, saves) -> None:
    d = str(tmp_path / "ckpt")
    engine = types.SimpleNamespace()
    ckpt = tds.open_checkpointer()
    assert tds.save_checkpoint(engine, d, job_id="job-a", checkpointer=ckpt) == f"saved {d}"
    first = lease.current(d).generation
    tds.save_checkpoint(engine, d, job_id="job-a", checkpointer=ckpt)  # claimed already: no new generation
    assert [s[1].generation for s in saves] == [first, first] and ckpt.leases == (d,)
    assert not lease.current(d).released  # held between the calls
    assert vars(engine) == {}  # nothing left on the user's engine

    ckpt.close()
    assert lease.current(d).released
    with pytest.raises(CheckpointerClosedError):
        tds.save_checkpoint(engine, d, job_id="job-a", checkpointer=ckpt)


def test_without_a_checkpointer_each_call_claims_and_releases_at_its_end(tmp_path, saves) -> None:
    d = str(tmp_path / "ckpt")
    tds.save_checkpoint(types.SimpleNamespace(), d, job_id="job-a")
    assert saves[0][1].job == "job-a" and not saves[0][1].released  # held while the save ran
    assert lease.current(d).released  # released at the end of the call
    tds.save_checkpoint(types.SimpleNamespace(), d, job_id="job-b")  # so another job takes it at once
    assert saves[1][1].job == "job-b" and lease.current(d).released
    tds.claim_save_dir(d, "job-c")  # a check that the directory may be written now: released at once too
    assert lease.current(d).job == "job-c" and lease.current(d).released


def test_another_jobs_directory_is_refused_before_anything_is_written(tmp_path, saves) -> None:
    d = str(tmp_path / "ckpt")
    with tds.open_checkpointer() as ckpt:
        tds.claim_save_dir(d, "job-a", checkpointer=ckpt)
        for call in (lambda: tds.save_checkpoint(types.SimpleNamespace(), d, job_id="job-b"),
                     lambda: tds.claim_save_dir(d, "job-b")):
            with pytest.raises(RankFailure) as e:  # refused on every rank, told the API's arguments
                call()
            msg = str(e.value)
            assert "LeaseError" in msg and d in msg and "job 'job-a'" in msg and "take_over=True" in msg
        assert saves == [] and lease.current(d).job == "job-a"
        tds.save_checkpoint(types.SimpleNamespace(), d, job_id="job-b", take_over=True)  # taken over, as asked
        assert saves[0][1].job == "job-b"


def test_a_directory_without_a_checkpoint_is_refused_naming_it(tmp_path) -> None:
    d = str(tmp_path / "empty")
    with pytest.raises(RankFailure) as e:
        tds.load_checkpoint(types.SimpleNamespace(), d)
    assert f"NoDeepSpeedCheckpointError: no complete tenplex checkpoint under {d}" in str(e.value)


def test_megatrons_own_checkpoint_is_refused_naming_the_directory(tmp_path) -> None:
    d = tmp_path / "megatron"
    (d / "iter_0000005").mkdir(parents=True)
    (d / "iter_0000005" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # megatron-core's
    (d / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(RankFailure) as e:
        tds.load_checkpoint(types.SimpleNamespace(), str(d))
    assert f"no complete tenplex checkpoint under {d}: {d / 'iter_0000005'} is Megatron's own checkpoint" \
        in str(e.value)


def test_for_api_claims_nothing_at_start_and_opens_no_tier() -> None:
    ckpt = Checkpointer.for_api("prog")
    assert ckpt.leases == () and ckpt.memory() is None and not ckpt.wants_memory
    ckpt.close()
    assert ckpt.closed
