"""Two gloo ranks: rank 1 alive but silent, rank 0 blocked receiving from it; after 1 s a thread of rank 0 shuts
its gloo connections down (``frontdoor.gloo_abort``), which must end the receive long before the gloo timeout.
Rank 0 writes ``{"ended_after": seconds, "error": message, "shut": connections}`` to ARGV[1]."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tenplex_megatron.frontdoor import gloo_abort

TIMEOUT = 60  # the gloo timeout the receive would otherwise wait out

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    store_port = int(os.environ["MASTER_PORT"])
    dist.barrier()
    if dist.get_rank() == 0:
        shut: list[int] = []
        aborter = threading.Thread(target=lambda: (time.sleep(1.0),
                                                   shut.append(gloo_abort.end_pending_gloo([store_port]))), daemon=True)
        aborter.start()
        t0, error = time.monotonic(), ""
        try:
            dist.recv(torch.zeros(4), src=1)
        except RuntimeError as e:
            error = str(e)
        aborter.join()
        with open(sys.argv[1], "w") as f:
            json.dump({"ended_after": time.monotonic() - t0, "error": error, "shut": shut}, f)
    else:
        time.sleep(10)  # alive, never sending: only the shutdown (or the timeout) ends rank 0's receive
