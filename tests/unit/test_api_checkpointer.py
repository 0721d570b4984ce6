"""The Checkpointer the DeepSpeed calls keep on their engine (``Checkpointer.for_api``): save directories claimed
at their first save, once per engine, released by ``close()``; real lease files, one process (world of one)."""

from __future__ import annotations

import types

import pytest

from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.frontdoor.checkpointer import Checkpointer, CheckpointerClosedError
from tenplex_megatron.integrations.deepspeed import adapter
from tenplex_megatron.storage import lease


def test_claim_once_per_engine_refuse_another_job_release_on_close(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    engine = types.SimpleNamespace()
    adapter.claim_save_dir(d, "job-a", engine=engine)
    ckpt = adapter.checkpointer(engine)
    assert ckpt is getattr(engine, adapter.CHECKPOINTER_ATTRIBUTE) and ckpt.leases == (d,)
    first = lease.current(d).generation
    adapter.claim_save_dir(d, "job-a", engine=engine)  # claimed already: no new generation
    assert lease.current(d).generation == first and lease.current(d).job == "job-a"

    with pytest.raises(RankFailure) as e:  # another job's engine: refused on every rank, told the API's arguments
        adapter.claim_save_dir(d, "job-b", engine=types.SimpleNamespace())
    assert "LeaseError" in str(e.value) and d in str(e.value) and "job 'job-a'" in str(e.value) and "take_over=True" in str(e.value)

    ckpt.close()
    assert lease.current(d).released
    with pytest.raises(CheckpointerClosedError):
        ckpt.claim_dir(d, "job-a")
    adapter.claim_save_dir(d, "job-b", engine=engine)  # a closed Checkpointer is replaced; the lease taken at once
    assert adapter.checkpointer(engine) is not ckpt and lease.current(d).job == "job-b"


def test_for_api_claims_nothing_at_start_and_opens_no_tier() -> None:
    ckpt = Checkpointer.for_api("prog")
    assert ckpt.leases == () and ckpt.memory() is None and not ckpt.wants_memory
    ckpt.close()
    assert ckpt.closed
