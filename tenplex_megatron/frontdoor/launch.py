"""The launcher of jobs that survive losing ranks in place (``--tenplex-inprocess``): one node's ranks, with the
job's stores served outside every rank.

    python -m tenplex_megatron.frontdoor.launch --nproc-per-node 4 scripts/pretrain_gpt.py ... --tenplex-inprocess
    # several nodes: one launcher per node, the first one serving the stores
    python -m tenplex_megatron.frontdoor.launch --nnodes 2 --node-rank R --master-addr NODE0 --nproc-per-node 4 ...

The first node's launcher (``--node-rank 0``) serves two TCP stores: the job's, on ``--master-port`` (every
restart's process group is made on a prefix of it), and NVIDIA Resiliency Extension's, on the next port. Every
launcher starts its node's ranks (global ranks from ``node-rank x nproc-per-node``) with torchrun's environment
variables plus ``TENPLEX_INPROCESS_STORE`` and, unlike torchrun, lets the others run on when one exits: NVRx's
wrapper in each rank decides who continues. The ranks take the job's checkpoint leases in their launcher's name
(it outlives every rank: ``frontdoor/inprocess_lease.py``); a rank that exits 3, fenced because another job took a
directory over, ends the job on its node: the node's other ranks are ended too. It prints its own and each rank's
process id at the start and each rank's exit status at the end, and exits 0 when every rank that exited on its own
exited 0 and at least one did (ranks ended by a signal are the faults the job survived), else with the first
failure's status. The stores live as long as the first node's launcher: the job continues in place after losing
any rank or any other node.
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
from tenplex_megatron.frontdoor.lease_flags import FENCED_EXIT


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tenplex_megatron.frontdoor.launch", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                allow_abbrev=False)
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (one launcher each; the same on every node)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (0: the one serving the stores)")
    p.add_argument("--master-addr", default="127.0.0.1", help="the first node's address (where the stores are)")
    p.add_argument("--master-port", type=int, default=29500, help="the job's store (NVRx's store: the next port)")
    p.add_argument("--timeout", type=float, default=None, help="end every rank still running after this many seconds")
    p.add_argument("script", help="the training script (run with this interpreter)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank must be in [0, --nnodes) and --nnodes >= 1, got --node-rank {a.node_rank} --nnodes "
                f"{a.nnodes}")
    return a


def serve_stores(addr: str, port: int) -> list[object]:
    """The job's store and NVRx's, served by this process for as long as it lives."""
    import torch.distributed as dist

    return [dist.TCPStore(addr, p, None, True, timeout=timedelta(seconds=300), wait_for_workers=False,
                          use_libuv=True) for p in (port, port + NVRX_STORE_OFFSET)]


def rank_env(a: argparse.Namespace, local: int) -> dict[str, str]:
    """torchrun's variables for this node's ``local``-th rank, plus where the stores are."""
    n = a.nproc_per_node
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # NVRx polls its store with short waits: each a c10d warning
    return dict(env, RANK=str(a.node_rank * n + local), LOCAL_RANK=str(local), WORLD_SIZE=str(a.nnodes * n),
                LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(a.node_rank), MASTER_ADDR=a.master_addr,
                MASTER_PORT=str(a.master_port), **{STORE_ENV: f"{a.master_addr}:{a.master_port}"})


def exit_status(codes: list[int | None]) -> int:
    """0 when every rank that exited on its own exited 0 and one did; else the first failure's status."""
    failed = [c for c in codes if c is not None and c > 0]
    if failed:
        return failed[0]
    return 0 if any(c == 0 for c in codes) else 1


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    stores = serve_stores(a.master_addr, a.master_port) if a.node_rank == 0 else []
    first = a.node_rank * a.nproc_per_node
    procs = [subprocess.Popen([sys.executable, a.script, *a.script_args], env=rank_env(a, r))
             for r in range(a.nproc_per_node)]
    print(f"> tenplex launch: ranks started, pids {' '.join(f'{first + r}:{p.pid}' for r, p in enumerate(procs))}; "
          f"stores on {a.master_addr}:{a.master_port} and :{a.master_port + NVRX_STORE_OFFSET}"
          f"{'' if a.node_rank == 0 else ' (served by node 0)'}; launcher pid {os.getpid()}", flush=True)
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
            fenced = [first + r for r, p in enumerate(procs) if p.poll() == FENCED_EXIT]
            if fenced:
                print(f"> tenplex launch: rank {fenced[0]} exited {FENCED_EXIT} (fenced: another job owns a checkpoint "
                      "directory): ending the ranks left", flush=True)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.wait() for p in procs]
    print(f"> tenplex launch: exit statuses {' '.join(f'{first + r}:{c}' for r, c in enumerate(codes))}", flush=True)
    del stores
    return exit_status(codes)


if __name__ == "__main__":
    sys.exit(main())
