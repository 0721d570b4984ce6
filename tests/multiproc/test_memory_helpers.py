"""Two nodes' memory-tier helpers replicating to each other over their own gloo group: byte-exact, paced, hurried.

Multi-process (each helper is a process of its own, joined by a TCP store): kept out of the unit tests' minute.
"""

from __future__ import annotations

import os

import pytest

from tenplex_megatron.memory.helper import Helper
from tenplex_megatron.memory.protocol import Receive, Replicate, Send
from tenplex_megatron.storage import directory
from tests.unit.test_memory_tier_parts import _answer

pytestmark = pytest.mark.dist


def test_replication_between_two_helpers_is_byte_exact_and_paced_by_the_rate(tmp_path) -> None:
    """Two nodes' helpers in their own gloo group swap replicas (messages larger than one slice), once as fast as
    they can and once capped at 40 MB/s: the capped one takes at least bytes / rate."""
    import time

    import torch.distributed as dist

    from tenplex_megatron.memory.helper import SLICE

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sizes = (2 * SLICE + 12345, SLICE // 3)  # node 0's file: 3 rounds of slices; node 1's: one
    nodes = [tmp_path / "a", tmp_path / "b"]
    files = []
    for i, (d, n) in enumerate(zip(nodes, sizes)):
        os.makedirs(d)
        path = d / directory.rank_file_name(i)
        path.write_bytes(os.urandom(n))
        files.append(path)
    helpers = [Helper((f"127.0.0.1:{store.port}", "t", i, 2)) for i in range(2)]
    try:
        spares = [nodes[i] / "spare" for i in range(2)]  # retired replicas: node 0's larger, node 1's smaller
        for i, n in enumerate((sizes[1] + 5000, sizes[0] // 2)):
            spares[i].write_bytes(os.urandom(n))
        inodes = [os.stat(sp).st_ino for sp in spares]
        # the third: capped at 1 MB/s (17 s for node 0's file), then both told to hurry (the job stops)
        for it, rate in ((1, 0.0), (2, 40e6), (3, 1e6)):
            t0 = time.monotonic()
            for i, h in enumerate(helpers):
                other = 1 - i
                spare = str(spares[i]) if it == 2 else None  # the second replication: over the spare's pages
                h.request(Replicate(it, (Send(str(files[i]), other, i),),
                                    (Receive(other, sizes[other], str(nodes[i] / f"r{it}_{other}"), other, spare),),
                                    rate))
            if it == 3:
                time.sleep(1.0)
                assert all(h.poll("replicate", 3) is None for h in helpers)  # still pacing
                for h in helpers:
                    h.hurry()
            got = [_answer(h, "replicate", it) for h in helpers]
            elapsed = time.monotonic() - t0
            assert all(g.ok for g in got), got
            for i in range(2):
                other = 1 - i
                assert (nodes[i] / f"r{it}_{other}").read_bytes() == files[other].read_bytes()
            if it == 2:
                assert elapsed >= sizes[0] / rate, elapsed  # node 0 sent its file no faster than the cap
            if it == 3:  # the hurry ended the pacing: done before the cap alone would let node 0's file through
                assert elapsed < sizes[0] / rate, elapsed
        for i in range(2):  # the spare became the replica (same inode), truncated to the replica's size
            assert not spares[i].exists() and os.stat(nodes[i] / f"r2_{1 - i}").st_ino == inodes[i]
    finally:
        for h in helpers:
            h.close()
