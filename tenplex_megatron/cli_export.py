"""``python -m tenplex_megatron export-hf`` and ``export-megatron``: a checkpoint written out of tenplex's format, as
a Hugging Face model or as Megatron-LM's own torch_dist checkpoint at a chosen layout. torch is imported only by the
export itself (``integrations/hf/export.py``; ``training/export_megatron.py`` in processes of its own)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Any

from tenplex_megatron._optional import require
from tenplex_megatron.cli_common import CLIError, fmt_bytes, plan_to, read_tenplex
from tenplex_megatron.plan.hf_map import HFMapError, parse_size
from tenplex_megatron.plan.layout import LayoutError, ModelShape, ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.planner import PlanError
from tenplex_megatron.plan.ptc import PTCError
from tenplex_megatron.storage.files import CheckpointFileError


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Export a checkpoint as a Hugging Face model (torch and transformers are imported only here)."""
    try:
        max_shard = parse_size(args.max_shard_size)
        ckpt, meta, _ = read_tenplex(args.checkpoint)  # the restart's choice of copy: damage skipped, read once
        export = require("tenplex_megatron.integrations.hf.export", "hf", needed_by="export-hf")
        res = export.export_hf(ckpt, args.out, args.dtype, max_shard, args.force, metadata=meta)
    except (HFMapError, PlanError, PTCError, CheckpointFileError, FileExistsError) as e:
        raise CLIError(str(e)) from None
    print(f"export-hf: {res.arch} model, {res.tensors} tensors, {fmt_bytes(res.bytes)} in {len(res.files)} "
          f"file(s) written to {res.path} in {res.seconds:.2f} s")
    return 0


def _check_empty_out(out: str) -> None:
    """Refuse an output path that is a file, or a directory that is not empty (nothing is ever overwritten)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"{out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise CLIError(f"{out}: not empty (export-megatron writes into a new or empty directory)")


def _remove_export(out: str, existed: bool) -> None:
    """After a failed export: remove what it wrote (``out`` was new, or empty)."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def cmd_export_megatron(args: argparse.Namespace) -> int:
    """Write a tenplex checkpoint as Megatron-LM's own torch_dist checkpoint at ``--to``: everything is checked here
    (without torch), then one process per target rank does the export (``training/export_megatron.py``)."""
    ckpt, meta, source = read_tenplex(args.checkpoint)
    if meta.framework not in (None, "megatron-core") or not meta.model:
        raise CLIError(f"{ckpt}: written by {meta.framework!r} without a megatron-core model record: "
                       "export-megatron reads megatron-core checkpoints")
    _check_empty_out(args.out)
    try:
        dst = ParallelLayout.parse(args.to)
        shape = ModelShape.from_record(dict(meta.model))
        dst.check_fits(shape)
    except (LayoutError, KeyError, TypeError, ValueError) as e:
        raise CLIError(f"--to {args.to}: {e}") from None
    distopt = bool(meta.use_distributed_optimizer)
    # Megatron's padding at the new TP: what a Megatron-LM run without the plugin builds
    plan_to(source, dst, distopt, padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, dst.tp))
    fmt = "fully_reshardable" if args.optimizer_format == "auto" else args.optimizer_format
    existed = os.path.isdir(args.out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dst.world_size),
           "-m", "tenplex_megatron.training.export_megatron", ckpt, args.out, args.to, fmt]
    # gloo on CPUs: one process per target rank, no GPU needed; megatron-core's warnings about the missing GPU
    # libraries (Apex, Transformer Engine) once per process are left out
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"export-megatron: {ckpt} (iteration {meta.iteration}) -> {args.out} at {dst} "
          f"({dst.world_size} processes)", flush=True)
    code = subprocess.run(cmd, env=env, check=False).returncode
    if code != 0:
        _remove_export(args.out, existed)
        raise CLIError(f"the export processes failed (exit status {code}; their output is above): nothing was left "
                       f"in {args.out}")
    return 0


def add_parsers(sub: Any) -> None:
    """The ``export-hf`` and ``export-megatron`` subcommands and their flags."""
    e = sub.add_parser("export-hf", help="write a checkpoint (any layout) as a Hugging Face transformers model "
                                         "directory, streaming one tensor at a time")
    e.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest checkpoint)")
    e.add_argument("out", help="the output directory (must be empty unless --force)")
    e.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="dtype of the written weights (default: the checkpoint's)")
    e.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    e.add_argument("--force", action="store_true", help="write into a non-empty directory")
    e.set_defaults(fn=cmd_export_hf)
    em = sub.add_parser("export-megatron", help="write a checkpoint as Megatron-LM's own torch_dist checkpoint at a "
                                              "chosen layout, for Megatron-LM without the plugin (one process per "
                                              "target rank, on CPUs)")
    em.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest checkpoint)")
    em.add_argument("out", help="the Megatron save directory to write (new or empty): iter_NNNNNNN/ and "
                                "latest_checkpointed_iteration.txt")
    em.add_argument("--to", required=True, help="the layout Megatron-LM will run at, e.g. tp=2,pp=2,dp=1 "
                                                "(ep=N for a mixture of experts)")
    em.add_argument("--format", choices=["torch_dist"], default="torch_dist", help="Megatron's checkpoint format "
                                                                                  "(--ckpt-format; torch_dist only)")
    em.add_argument("--optimizer-format", choices=["auto", "dp_reshardable", "fully_reshardable"], default="auto",
                    help="the distributed optimizer's format; auto: fully_reshardable (model space: loads whatever "
                         "DDP buckets the loading job cuts; dp_reshardable is stored as the export's own buckets)")
    em.set_defaults(fn=cmd_export_megatron)
