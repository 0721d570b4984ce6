"""``python -m tenplex_megatron``: inspect or verify a checkpoint, dry-run a re-shard plan, rank layouts, export. Only
the export commands import torch (and megatron-core), and ``leave`` torch's store client; the others never do
(tested).

    python -m tenplex_megatron --version        (or the console script: tenplex-megatron --version)
    python -m tenplex_megatron inspect CKPT [--tensors] [--json]
    python -m tenplex_megatron verify CKPT [--all] [--json] [--workers N]
    python -m tenplex_megatron plan CKPT --to tp=2,pp=2,dp=1 [--gpus-per-node 8] [--json]
    python -m tenplex_megatron plan --model gpt3-175b --from tp=8,pp=16,dp=8 --to tp=8,pp=8,dp=16 --gpus-per-node 8
    python -m tenplex_megatron layouts --model gpt3-1.3b --gpus 12 --gpus-per-node 4 [--memory-gb 80] [--json]
    python -m tenplex_megatron export-hf CKPT OUT [--dtype bf16|fp32] [--max-shard-size 5GB] [--force]
    python -m tenplex_megatron export-megatron CKPT OUT --to tp=1,pp=2,dp=2 [--format torch_dist]
        [--optimizer-format auto|dp_reshardable|fully_reshardable]
    python -m tenplex_megatron simulate --trace TRACE --model NAME --global-batch-size N --target-iteration N
        [--times FILE] [--policies auto,dp_only,table,measure] [--out r.json] [--plot r.png]
    python -m tenplex_megatron leave --node-rank R [--master-addr NODE0] [--master-port 29500]
"""

from __future__ import annotations

import argparse
import os
import sys

from tenplex_megatron import (
    __version__,
    cli_export,
    cli_inspect,
    cli_layouts,
    cli_plan,
    cli_reform,
    cli_simulate,
    cli_verify,
)
from tenplex_megatron.cli_common import CLIError  # also importable from here, as before the commands moved out
from tenplex_megatron.memory import node_dir


def cmd_clean_memory(args: argparse.Namespace) -> int:
    """Remove the snapshots a finished job left in a memory directory (its node id stays)."""
    if not os.path.isdir(args.directory):
        raise CLIError(f"{args.directory}: no such directory")
    if not os.path.isfile(os.path.join(args.directory, node_dir.NODE_FILE)):
        raise CLIError(f"{args.directory}: not a tenplex memory directory (no {node_dir.NODE_FILE}); nothing removed")
    removed = node_dir.clean(args.directory)
    for path in removed:
        print(f"removed {path}")
    print(f"clean-memory: {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} removed from {args.directory}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, each added by the module that runs it."""
    p = argparse.ArgumentParser(prog="python -m tenplex_megatron", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tenplex-megatron {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    cli_inspect.add_parser(sub)
    cli_verify.add_parser(sub)
    cli_plan.add_parser(sub)
    cli_layouts.add_parser(sub)
    cli_export.add_parsers(sub)
    cm = sub.add_parser("clean-memory", help="remove the host-memory snapshots (--tenplex-memory) a finished job "
                                             "left in a node's memory directory")
    cm.add_argument("directory")
    cm.set_defaults(fn=cmd_clean_memory)
    cli_simulate.add_parser(sub)
    cli_reform.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a ``CLIError`` is one line on stderr and exit status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CLIError, cli_simulate.SimulateError) as e:
        print(f"tenplex_megatron: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as a Unix filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
