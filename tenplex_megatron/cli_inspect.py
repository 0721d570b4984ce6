"""``python -m tenplex_megatron inspect``: a checkpoint's layout, iteration, tensors and bytes, tenplex's or
Megatron's own. Never imports torch."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from tenplex_megatron.cli_common import CLIError, fmt_bytes, megatron_checkpoint, read_tenplex
from tenplex_megatron.plan.experts import expert_summary
from tenplex_megatron.plan.ptc import dtype_size
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import is_legacy_megatron_checkpoint
from tenplex_megatron.storage.megatron_summary import summarize, summarize_legacy


def _inspect_megatron(path: str, args: argparse.Namespace) -> int:
    try:
        summary = summarize_legacy(path) if is_legacy_megatron_checkpoint(path) else summarize(path)
    except CheckpointFileError as e:
        raise CLIError(str(e)) from None
    table = summary.pop("tensor_table")
    experts_line = summary.pop("experts_line", None)
    if args.json:
        if args.tensors:
            summary["tensor_table"] = table
        print(json.dumps(summary, indent=1))
        return 0
    lay = summary["layout"]
    print(f"checkpoint   {path}  ({summary['format']}: Megatron's own, adopted at any layout with --tenplex)")
    print(f"iteration    {summary['iteration']}  (consumed samples {summary['consumed_samples']})")
    experts = summary.get("experts")
    print(f"layout       tp={lay['tp']} pp={lay['pp']} dp={lay['dp']}"
          + (f" ep={lay.get('ep', 1)} expert-tp={experts['expert_tp']}" if experts else "")
          + f"  ({summary.get('layout_source', 'as the index shows it')})  "
          f"distributed optimizer: {summary['distributed_optimizer']}")
    if experts_line:
        print(f"experts      {experts_line}")
    print(f"tensors      {summary['tensors']} ({summary['model_parameters']:,} model parameters), "
          f"{summary['chunks']} stored chunks")
    print(f"bytes        {fmt_bytes(summary['bytes'])} in {len(summary['files'])} files")
    if args.tensors:
        width = max(len(k) for k in table)
        print(f"\n{'tensor':<{width}}  {'shape':<18} {'dtype':<9} {'chunks':>6}")
        for k, t in table.items():
            print(f"{k:<{width}}  {str(t['shape']):<18} {t['dtype']:<9} {t['chunks']:>6}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if (mck := megatron_checkpoint(args.checkpoint)) is not None:
        return _inspect_megatron(mck, args)
    ckpt, meta, ptc = read_tenplex(args.checkpoint)
    per_tensor: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for sc in ptc.chunks:
        per_tensor[sc.chunk.key][0] += 1
        per_tensor[sc.chunk.key][1] += sc.chunk.numel * dtype_size(ptc.tensors[sc.chunk.key].dtype)
    model_params = sum(t.numel for t in ptc.tensors.values() if t.param is None)
    summary = {
        "path": ckpt,
        "iteration": meta.iteration,
        "consumed_samples": meta.consumed_samples,
        "layout": None if meta.layout is None else dict(meta.layout),
        "distributed_optimizer": meta.use_distributed_optimizer,
        "padded_vocab_size": meta.padded_vocab_size,
        "model": None if meta.model is None else dict(meta.model),
        "tensors": len(ptc.tensors),
        "model_parameters": model_params,
        "chunks": len(ptc.chunks),
        "bytes": ptc.total_bytes(),
        "files": dict(meta.files or {}),
    }
    experts = expert_summary(ptc, summary["layout"])
    summary["experts"] = experts.to_json() if experts is not None else None
    if args.json:
        if args.tensors:
            summary["tensor_table"] = {k: {"shape": list(t.global_shape), "dtype": t.dtype, "chunks": per_tensor[k][0],
                                           "bytes": per_tensor[k][1]} for k, t in ptc.tensors.items()}
        print(json.dumps(summary, indent=1))
        return 0
    lay = summary["layout"] or {}
    print(f"checkpoint   {ckpt}")
    print(f"iteration    {summary['iteration']}  (consumed samples {summary['consumed_samples']})")
    print(f"layout       tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')}"
          + (f" ep={lay.get('ep', 1)} expert-tp={experts.expert_tp}" if experts is not None else "")
          + f"  distributed optimizer: {summary['distributed_optimizer']}")
    if experts is not None:
        print(f"experts      {experts.line()}")
    print(f"tensors      {summary['tensors']} ({model_params:,} model parameters), {summary['chunks']} stored chunks")
    print(f"bytes        {fmt_bytes(summary['bytes'])} in {len(summary['files'])} files")
    if args.tensors:
        width = max(len(k) for k in ptc.tensors)
        print(f"\n{'tensor':<{width}}  {'shape':<18} {'dtype':<9} {'chunks':>6} {'bytes':>12}")
        for k, t in ptc.tensors.items():
            print(f"{k:<{width}}  {str(list(t.global_shape)):<18} {t.dtype:<9} {per_tensor[k][0]:>6} "
                  f"{fmt_bytes(per_tensor[k][1]):>12}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand and its flags."""
    i = sub.add_parser("inspect", help="layout, tensors, bytes and iteration of a checkpoint")
    i.add_argument("checkpoint")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)
