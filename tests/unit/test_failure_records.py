"""A failure that crosses ranks (``execute/collective.py``) or comes from a node's helper process
(``memory/protocol.py``) travels as a :class:`~tenplex_megatron.errors.Failure` record, and its readers (the restart
fallback, the lease fence, the background persist) test its kind, never the words of its message."""

from __future__ import annotations

import json

import pytest

from tenplex_megatron.errors import Failure, kind_of
from tenplex_megatron.execute.collective import DESCRIBE_LIMIT, RankFailure, run_phase
from tenplex_megatron.frontdoor import lease_flags
from tenplex_megatron.memory import background, fallback
from tenplex_megatron.storage.files import CheckpointFileError, CheckpointNotFoundError
from tenplex_megatron.storage.lease import FencedError, LeaseError
from tests.logs import logged


def _failed(error: BaseException) -> RankFailure:
    """The RankFailure one process's run_phase raises when its local work raises ``error``."""

    def work() -> None:
        raise error

    with pytest.raises(RankFailure) as e:
        run_phase("a phase", work)
    return e.value


def test_the_failure_travels_as_a_record_and_its_words_are_unchanged() -> None:
    e = _failed(OSError(28, "No space left on device"))
    assert str(e) == "a phase failed on 1 rank(s):\n  rank 0: OSError: [Errno 28] No space left on device"
    assert e.failures == {0: Failure("OSError", "[Errno 28] No space left on device", "OSError")}
    assert Failure.from_json(json.loads(json.dumps(e.failures[0].to_json()))) == e.failures[0]


def test_long_words_are_cut_where_they_were() -> None:
    e = _failed(ValueError("x" * 3 * DESCRIBE_LIMIT))
    words = str(e.failures[0])
    assert words == ("ValueError: " + "x" * 3 * DESCRIBE_LIMIT)[:DESCRIBE_LIMIT] + " [...]"


def test_a_kind_is_the_classs_own() -> None:
    assert FencedError.kind == "FencedError" and LeaseError.kind == "LeaseError"  # not inherited from the base
    assert kind_of(FencedError("x")) == "FencedError" and kind_of(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert CheckpointNotFoundError.kind == "CheckpointNotFoundError" != CheckpointFileError.kind


def test_the_fence_is_found_by_kind_not_by_words() -> None:
    e = _failed(FencedError("/ckpt: a newer generation owns the directory"))
    assert lease_flags.fenced(e) == "/ckpt: a newer generation owns the directory"
    assert lease_flags.fenced(_failed(RuntimeError("FencedError: words that only look like a fence"))) is None


@pytest.mark.parametrize("error", [CheckpointFileError("f: truncated"), CheckpointNotFoundError("f: missing"),
                                   FileNotFoundError("f"), LeaseError("lease: malformed")], ids=kind_of)
def test_a_damaged_copy_is_found_by_kind(error: BaseException) -> None:
    e = _failed(error)
    assert fallback.damage(e) == str(e)


@pytest.mark.parametrize("error", [ValueError("CheckpointFileError: words that only look like damage"),
                                   FencedError("newer"), KeyboardInterrupt()], ids=kind_of)
def test_another_failure_is_no_damage(error: BaseException) -> None:
    assert fallback.damage(_failed(error)) is None


class _Tier:
    """The few fields of a MemoryTier a failed persist touches."""

    pending: int | None = 5
    pending_meta: dict | None = {}
    replicating = None


def test_a_fenced_persist_stops_the_job_and_another_failure_is_logged() -> None:
    tier = _Tier()
    with pytest.raises(FencedError, match="^/ckpt: newer$"):
        background._persist_failed(tier, "save", Failure.of(FencedError("/ckpt: newer")))  # type: ignore[arg-type]
    assert tier.pending is None
    tier.pending = 6
    with logged() as records:
        background._persist_failed(tier, "save", Failure.of(OSError("FencedError: gone")))  # type: ignore[arg-type]
    assert tier.pending is None and any("OSError: FencedError: gone" in r.getMessage() for r in records)
