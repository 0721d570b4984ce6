"""``tenplex-megatron leave`` (cli_reform.py) against a real TCPStore standing for node 0's launcher: a node named by
its launcher gets a leave notice naming its ranks; the node serving the store is refused in one line (nothing
written); an unknown node and a store nobody serves are named."""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from tenplex_megatron.cli import main
from tenplex_megatron.frontdoor.membership import Generation, Membership


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def job() -> tuple[Membership, int]:
    port = _port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False,
                           use_libuv=True)
    m = Membership(server)
    m.publish(Generation(0, ("h:1", "h:2", "h:3", "h:4")))
    m.name_node(0, ["h:1", "h:2"], serving=True)
    m.name_node(1, ["h:3", "h:4"], serving=False)
    return m, port


def test_a_node_leaves_by_command(job: tuple[Membership, int], capsys: pytest.CaptureFixture[str]) -> None:
    m, port = job
    gen = m.generation(0)
    assert main(["leave", "--node-rank", "1", "--master-port", str(port)]) == 0
    assert "node 1's ranks (h:3, h:4) leave the job at its next iteration boundary" in capsys.readouterr().out
    assert m.pending(gen) and json.loads(bytes(m.store.get("tenplex-members/leave/1"))) == ["h:3", "h:4"]
    assert m.propose(gen, lambda n: True).members == ("h:1", "h:2")


def test_node_0_is_refused_in_one_line(job: tuple[Membership, int], capsys: pytest.CaptureFixture[str]) -> None:
    m, port = job
    assert main(["leave", "--node-rank", "0", "--master-port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--node-rank 0" in err and "serves the job's store" in err and "SIGTERM" in err
    assert not m.pending(m.generation(0))  # nothing written


def test_an_unknown_node_and_a_missing_store_are_named(job: tuple[Membership, int],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _, port = job
    assert main(["leave", "--node-rank", "5", "--master-port", str(port)]) == 2
    assert "--node-rank 5: no such node" in capsys.readouterr().err
    assert main(["leave", "--node-rank", "1", "--master-port", str(_port()), "--wait", "0.5"]) == 2
    assert "no job's store at 127.0.0.1:" in capsys.readouterr().err
