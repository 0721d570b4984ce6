"""The launcher of jobs that survive losing ranks in place (``--tenplex-inprocess``): one node's ranks, with the
job's stores served here, outside every rank.

    python -m tenplex_megatron.frontdoor.launch --nproc-per-node 4 scripts/pretrain_gpt.py ... --tenplex-inprocess

It serves two TCP stores (the job's, on ``--master-port``: every restart's process group is made on a prefix of
it; and NVIDIA Resiliency Extension's, on the next port), starts the ranks with torchrun's environment variables
plus ``TENPLEX_INPROCESS_STORE``, and, unlike torchrun, lets the others run on when one exits: NVRx's wrapper in
each rank decides who continues. It prints each rank's process id at the start and its exit status at the end,
and exits 0 when every rank that exited on its own exited 0 and at least one did (ranks ended by a signal are
the faults the job survived), else with the first failure's status. One node only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from tenplex_megatron.frontdoor.inprocess import NVRX_STORE_OFFSET, STORE_ENV


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tenplex_megatron.frontdoor.launch", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500, help="the job's store (NVRx's store: the next port)")
    p.add_argument("--timeout", type=float, default=None, help="end every rank still running after this many seconds")
    p.add_argument("script", help="the training script (run with this interpreter)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    return a


def serve_stores(addr: str, port: int) -> list[object]:
    """The job's store and NVRx's, served by this process for as long as it lives."""
    import torch.distributed as dist

    return [dist.TCPStore(addr, p, None, True, timeout=timedelta(seconds=300), wait_for_workers=False,
                          use_libuv=True) for p in (port, port + NVRX_STORE_OFFSET)]


def rank_env(a: argparse.Namespace, rank: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` (one node), plus where the stores are."""
    n = str(a.nproc_per_node)
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # NVRx polls its store with short waits: each a c10d warning
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n,
                GROUP_RANK="0", MASTER_ADDR=a.master_addr, MASTER_PORT=str(a.master_port),
                **{STORE_ENV: f"{a.master_addr}:{a.master_port}"})


def exit_status(codes: list[int | None]) -> int:
    """0 when every rank that exited on its own exited 0 and one did; else the first failure's status."""
    failed = [c for c in codes if c is not None and c > 0]
    if failed:
        return failed[0]
    return 0 if any(c == 0 for c in codes) else 1


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    stores = serve_stores(a.master_addr, a.master_port)
    procs = [subprocess.Popen([sys.executable, a.script, *a.script_args], env=rank_env(a, r))
             for r in range(a.nproc_per_node)]
    print(f"> tenplex launch: ranks started, pids {' '.join(f'{r}:{p.pid}' for r, p in enumerate(procs))}; "
          f"stores on {a.master_addr}:{a.master_port} and :{a.master_port + NVRX_STORE_OFFSET}", flush=True)
    forward = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda sig, _f: [p.send_signal(sig) for p in procs if p.poll() is None])
                for s in forward}
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    try:
        while any(p.poll() is None for p in procs):
            if deadline is not None and time.monotonic() > deadline:
                print(f"> tenplex launch: --timeout {a.timeout:g} s reached: ending the ranks left", flush=True)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.wait() for p in procs]
    print(f"> tenplex launch: exit statuses {' '.join(f'{r}:{c}' for r, c in enumerate(codes))}", flush=True)
    del stores
    return exit_status(codes)


if __name__ == "__main__":
    sys.exit(main())
