"""``python -m tenplex_megatron verify``: read every stored chunk of one checkpoint or all under a save directory and
check it (``storage/verify_ckpt.py``), with a progress line; exit 1 naming what is damaged. Never imports torch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tenplex_megatron.cli_common import CLIError, fmt_bytes
from tenplex_megatron.storage.verify_ckpt import CheckReport, checkpoints_in, default_workers, verify_checkpoint


class _Progress:
    """A progress line on stderr for long checks: rewritten in place on a terminal, a new line every
    ``every`` seconds otherwise (logs); nothing for a check that ends sooner."""

    def __init__(self, name: str, every: float | None):
        self.tty = sys.stderr.isatty()
        self.every = every if every is not None else (0.5 if self.tty else 10.0)
        self.name = name
        self.t0 = self.last = time.perf_counter()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last, self.shown = now, True
        rate = done / max(now - self.t0, 1e-9)
        line = (f"verify: {self.name}: {fmt_bytes(done)} of {fmt_bytes(total)} ({100 * done / max(total, 1):.0f}%), "
                f"{rate / 1e9:.2f} GB/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.tty and self.shown:
            print(file=sys.stderr)


def _print_report(r: CheckReport) -> None:
    it = f"iteration {r.iteration}, " if r.iteration is not None else ""
    what = (f"{it}{r.files} files, {r.tensors} tensors in {r.chunks} stored chunks, "
            f"{fmt_bytes(r.bytes_checked)} read, {r.blocks} checksums in {r.seconds:.2f} s "
            f"({r.gb_per_s:.2f} GB/s, {r.threads} threads)")
    if r.ok:
        print(f"OK       {r.path}: {what}")
        if r.experts is not None:
            print(f"  experts: {r.experts.line()}")
        return
    print(f"DAMAGED  {r.path}: {len(r.damage)} problem{'s' if len(r.damage) != 1 else ''} ({what})")
    for d in r.damage:
        print(f"  {d.why}")
    if r.experts is not None:
        print(f"  experts: {r.experts.line()}")
    print(f"  damaged files:   {', '.join(r.damaged_files())}")
    if r.damaged_tensors():
        print(f"  damaged tensors: {', '.join(r.damaged_tensors())}")


def cmd_verify(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise CLIError(f"--workers must be at least 1, got {args.workers}")
    paths = checkpoints_in(args.checkpoint, args.all)
    if not paths:
        raise CLIError(f"{args.checkpoint}: no tenplex checkpoint here")
    reports = []
    for path in paths:
        progress = _Progress(os.path.basename(os.path.normpath(path)), args.progress_every)
        try:
            reports.append(verify_checkpoint(path, args.workers or default_workers(), progress))
        finally:
            progress.end()
        if not args.json:
            _print_report(reports[-1])
    bad = [r for r in reports if not r.ok]
    if args.json:
        print(json.dumps({"ok": not bad, "checkpoints": [r.to_json() for r in reports]}, indent=1))
    else:
        checked = sum(r.bytes_checked for r in reports)
        seconds = sum(r.seconds for r in reports)
        print(f"verify: {len(reports) - len(bad)} of {len(reports)} checkpoints intact, "
              f"{fmt_bytes(checked)} checked in {seconds:.2f} s ({checked / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    return 1 if bad else 0


def add_parser(sub: Any) -> None:
    """The ``verify`` subcommand and its flags."""
    v = sub.add_parser("verify", help="read every stored chunk and check its checksums, file sizes and the "
                                      "tensors' partition, without a model (exit 1 naming what is damaged)")
    v.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest checkpoint)")
    v.add_argument("--all", action="store_true", help="every checkpoint under the save directory")
    v.add_argument("--json", action="store_true")
    v.add_argument("--workers", type=int, default=None, help="reading threads (default: the CPUs available)")
    v.add_argument("--progress-every", type=float, default=None, help=argparse.SUPPRESS)  # seconds between lines
    v.set_defaults(fn=cmd_verify)
