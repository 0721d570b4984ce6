"""The phase runner's records: every rank's result of a gathering phase travels as JSON and must come back equal,
field by field, so that every rank decides from the same values (``execute/collective.py``: ``gather_records``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tenplex_megatron.engine.load import RankReads
from tenplex_megatron.engine.save_records import Held, RankFile, RankHoldings
from tenplex_megatron.errors import Failure
from tenplex_megatron.memory.background import HelperCheck, NodeProgress, Progress
from tenplex_megatron.memory.restart import DamagedCopies, NodeListing
from tenplex_megatron.memory.snapshot import NodeRoom
from tenplex_megatron.memory.state import NodeIdentity
from tenplex_megatron.plan.peer_schedule import PeerKey, PeerRequest, RankRequests
from tenplex_megatron.plan.ptc import Chunk, TensorMeta

META = TensorMeta("w", (4, 6), "float32")
HOLDINGS = RankHoldings((Held(Chunk("w", (0, 0), (2, 6)), True, 48, META),
                         Held(Chunk("w", (2, 0), (2, 6), flat=(0, 5)), False, 20, META)))
PROGRESS = NodeProgress({"persist": Progress("failed", Failure.of(OSError(28, "No space left on device"))),
                         "replicate": Progress("failed", Failure("helper_exited", "helper exited: -9"))})

RECORDS: list[Any] = [
    HOLDINGS,
    RankHoldings(()),
    RankFile({"rng": {"seed": 1}, "rank_local": {"te": {"nbytes": 3}}}, "rank_00001.safetensors", 1234, "node-a",
             1 << 20, {"w@0,0": (1, 2, 3)}),
    RankFile({}, None, 0, "node-b", 1 << 20, {}),
    PROGRESS,
    NodeProgress(),
    HelperCheck(True, "helper exited: -9"),
    HelperCheck(False, None),
    NodeRoom(HOLDINGS, 7, 1 << 30, 1 << 20, PROGRESS),
    NodeIdentity("3f2a"),
    DamagedCopies("3f2a", ("rank_00000.safetensors", "rank_00002.safetensors")),
    RankRequests((PeerRequest(PeerKey("rank_00001.safetensors", "w@0,0"), 0, 64),)),
    RankReads(("w",), "node-a", (("rank_00000.safetensors", 0, 4),)),
    NodeListing((), 12),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_gathered_record_comes_back_equal(record: Any) -> None:
    sent = json.loads(json.dumps(record.to_json()))  # what the all-gather carries: JSON text, nothing pickled
    assert type(record).from_json(sent) == record


def test_an_empty_node_progress_travels_as_null() -> None:
    """Ranks other than a node's first say nothing about the background work: null on the wire, as before."""
    assert NodeProgress().to_json() is None
    assert NodeProgress.from_json(None) == NodeProgress()
