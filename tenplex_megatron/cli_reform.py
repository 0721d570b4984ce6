"""``tenplex-megatron leave``: a node of a job that re-forms in place (the launcher's ``--reform``) leaves at the next
iteration boundary, as SIGTERM to its launcher makes it: a leave notice naming its ranks, written to the job's store.
Node 0's launcher serves the store, so node 0 cannot leave in place: refused, naming what stops the job instead.
Imports torch (a client of the job's TCPStore) only when run."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from tenplex_megatron.cli_common import CLIError

STORE_WAIT = 10.0  # seconds to reach the job's store before giving up


def add_parser(sub: Any) -> None:
    p = sub.add_parser("leave", help="a node of a job re-forming in place (launch --reform) leaves at the next "
                                     "iteration boundary; its ranks exit 0")
    p.add_argument("--node-rank", type=int, required=True, help="the node that leaves (its launcher's --node-rank)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (the job's store)")
    p.add_argument("--master-port", type=int, default=29500, help="the job's store port (the launchers' --master-port)")
    p.add_argument("--wait", type=float, default=STORE_WAIT, help="seconds to reach the store (default %(default)g)")
    p.set_defaults(fn=cmd_leave)


def _store(addr: str, port: int, wait: float) -> Any:
    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=wait), wait_for_workers=False,
                             use_libuv=True)
    except RuntimeError as e:
        raise CLIError(f"no job's store at {addr}:{port} (--master-addr, --master-port) within {wait:g} s: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def cmd_leave(args: argparse.Namespace) -> int:
    """Write the leave notice for ``--node-rank``'s ranks (refused for the node serving the store)."""
    from tenplex_megatron.frontdoor.membership import Membership

    members = Membership(_store(args.master_addr, args.master_port, args.wait), timeout=args.wait)
    ids, serving = members.node(args.node_rank)
    if ids is None:
        raise CLIError(f"--node-rank {args.node_rank}: no such node in the job at {args.master_addr}:"
                       f"{args.master_port} (its launcher names it when started with --reform or --join)")
    if serving == args.node_rank:
        raise CLIError(f"--node-rank {args.node_rank}: this node's launcher serves the job's store, so it cannot "
                       "leave in place; stop the whole job on notice instead (SIGTERM to its launcher: every rank "
                       "saves and exits 0)")
    k = members.notice_leave(ids)
    print(f"leave: notice {k}: node {args.node_rank}'s ranks ({', '.join(ids)}) leave the job at its next iteration "
          "boundary")
    return 0
