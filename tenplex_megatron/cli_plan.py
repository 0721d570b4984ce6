"""``python -m tenplex_megatron plan``: a dry run of a re-shard, from a checkpoint (tenplex's or Megatron's own) or
from a named model at a layout: the bytes each destination rank would read. Never imports torch."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.cli_common import CLIError, fmt_bytes, megatron_checkpoint, plan_to, read_tenplex
from tenplex_megatron.cli_options import add_job_options, distributed_optimizer
from tenplex_megatron.plan.layout import (
    LayoutError,
    ModelShape,
    ParallelLayout,
    padded_vocab_size,
    restart_padded_vocab_size,
)
from tenplex_megatron.plan.ptc import PTC, dtype_size
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import load_model
from tenplex_megatron.storage.checkpoint_metadata import missing_shape
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import is_legacy_megatron_checkpoint
from tenplex_megatron.storage.megatron_legacy import describe_legacy, legacy_model_metas
from tenplex_megatron.storage.megatron_ptc import describe_torch_dist, index_model_metas
from tenplex_megatron.storage.megatron_summary import read_common, read_torch_pickle
from tenplex_megatron.storage.megatron_torch_dist import read_torch_dist


@dataclass(frozen=True)
class _Saved:
    """What ``plan`` needs of a checkpoint's record, tenplex's or Megatron's own."""

    layout: Mapping[str, int]
    distributed_optimizer: bool
    padded_vocab_size: int | None
    framework: str | None = None


def cmd_plan(args: argparse.Namespace) -> int:
    if args.model:
        return _plan_model(args)
    if not args.checkpoint:
        raise CLIError("plan needs a checkpoint directory, or --model NAME --from LAYOUT")
    t_read = time.perf_counter()
    if (mck := megatron_checkpoint(args.checkpoint)) is not None:
        ckpt, saved, source, shape = _describe_megatron(mck)
    else:
        ckpt, meta, source = read_tenplex(args.checkpoint)
        if meta.framework != "deepspeed" and (meta.model is None or missing_shape(meta.model)):
            field = "model" if meta.model is None else f"model.{missing_shape(meta.model)}"
            raise CLIError(f"{ckpt}: {meta.path}: {field}: missing (plan needs the model's shape)")
        shape = ModelShape.from_record(dict(meta.model or {})) if meta.framework != "deepspeed" else None
        saved = _Saved(meta.layout or {}, bool(meta.use_distributed_optimizer), meta.padded_vocab_size, meta.framework)
    read_seconds = time.perf_counter() - t_read
    try:
        dst = ParallelLayout.parse(args.to)
    except LayoutError as e:
        raise CLIError(str(e)) from None
    if saved.framework == "deepspeed":
        raise CLIError(f"{ckpt}: a DeepSpeed checkpoint: its ZeRO partitions at a new DP size are computed by "
                       "DeepSpeed at load, so `plan --to` is not supported for it (`inspect` is)")
    try:
        if shape is not None:
            dst.check_fits(shape)
    except LayoutError as e:
        raise CLIError(str(e)) from None
    vocab, divisible_by = _vocab(shape, source)
    distopt = distributed_optimizer(args, saved.distributed_optimizer)
    saved_vocab = saved.padded_vocab_size
    if args.vocab_padding == "keep":
        padded = restart_padded_vocab_size(vocab, divisible_by, dst.tp, saved_vocab)
    else:
        padded = padded_vocab_size(vocab, divisible_by, dst.tp)
    t0 = time.perf_counter()
    plan = plan_to(source, dst, distopt, padded)
    report = plan_report(plan, source, dst, args.gpus_per_node, 0.0)
    seconds = time.perf_counter() - t0  # the destination's chunks, the plan and its totals
    report.update({"plan_seconds": seconds, "read_seconds": read_seconds})
    report.update({"checkpoint": ckpt, "from": dict(saved.layout), "to": dst.to_json(),
                   "distributed_optimizer": distopt, "padded_vocab_size": padded})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    src = dict(saved.layout)
    try:  # the saving layout as layouts print (EP, expert TP, VPP, SP included), else the raw degrees
        shown = str(ParallelLayout.from_json(src))
    except (KeyError, TypeError, ValueError):
        shown = f"tp={src.get('tp')},pp={src.get('pp')},dp={src.get('dp')}"
    print(f"plan         {shown} -> {dst}  "
          f"({dst.world_size} ranks, distributed optimizer: {distopt}, padded vocab {padded})")
    copies = "" if report["distinct_state_bytes"] == report["state_bytes"] else \
        f" stored, {fmt_bytes(report['distinct_state_bytes'])} of it distinct (the rest: copies it keeps of replicas)"
    print(f"state        {fmt_bytes(report['state_bytes'])}{copies}")
    print(f"read total   {fmt_bytes(report['bytes_total'])}  "
          f"(per rank max {fmt_bytes(report['bytes_per_rank_max'])}, mean {fmt_bytes(report['bytes_per_rank_mean'])})")
    if args.gpus_per_node:
        print(f"cross-node   {fmt_bytes(report['bytes_cross_node'])} "
              f"({args.gpus_per_node} GPUs per node; peer-to-peer transfer)")
    print(f"time         {(read_seconds + seconds) * 1000:.1f} ms: read the checkpoint's metadata "
          f"{read_seconds * 1000:.1f} ms, plan and totals {seconds * 1000:.1f} ms")
    if args.per_rank:
        for r, b in report["bytes_per_rank"].items():
            print(f"  rank {r:>5}: {fmt_bytes(b)}")
    return 0


def _vocab(shape: ModelShape | None, source: PTC) -> tuple[int, int]:
    """The real vocabulary and its padding rule: the model record's, or (a Megatron checkpoint without args) the word
    embedding's rows as the checkpoint holds them, padded to a multiple of 128 (Megatron-LM's default)."""
    if shape is not None:
        return shape.vocab_size, shape.make_vocab_size_divisible_by
    emb = source.tensors.get("embedding.word_embeddings.weight")
    return (emb.vocab_rows or emb.global_shape[0]) if emb is not None else 0, 128


def _describe_megatron(path: str) -> tuple[str, _Saved, PTC, ModelShape | None]:
    """Megatron's own checkpoint as ``plan`` sees it, without torch: its meta, its stored chunks as a PTC (the same
    description adoption uses, ``storage/megatron_ptc.py``) and its shape when ``common.pt`` holds the args."""
    try:
        if is_legacy_megatron_checkpoint(path):
            files: dict[str, Any] = {}

            def load(name: str) -> Any:
                if name not in files:
                    files[name] = read_torch_pickle(confine(path, name, "the legacy layout"))
                return files[name]

            ptc, _, a = describe_legacy(path, load, *legacy_model_metas(path, load))
            distopt = any(os.path.isfile(os.path.join(path, n, "distrib_optim.pt")) for n in os.listdir(path))
        else:
            ck = read_torch_dist(path, read_common)
            metas, layer_keys = index_model_metas(ck)
            wanted = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if any(t.dtype != "float32" for t in metas.values())
                                                  else set())
            ptc = describe_torch_dist(ck, metas, layer_keys, wanted)
            distopt, a = ck.sharding_type is not None, ck.common.get("args")
    except CheckpointFileError as e:
        raise CLIError(str(e)) from None
    emb = ptc.tensors.get("embedding.word_embeddings.weight")
    saved = _Saved(ptc.layout, bool(distopt), emb.global_shape[0] if emb is not None else None)
    shape = None
    if a is not None and all(hasattr(a, n) for n in ("num_layers", "hidden_size", "num_attention_heads")):
        rows = emb.vocab_rows if emb is not None else 0
        shape = ModelShape.from_record({**vars(a), "vocab_size": getattr(a, "vocab_size", None) or rows})
    return path, saved, ptc, shape


def _plan_model(args: argparse.Namespace) -> int:
    """Dry run for a named model with no checkpoint: the source is what a tenplex save at --from would write."""
    if not args.source:
        raise CLIError("--model needs --from LAYOUT (e.g. --from tp=8,pp=16,dp=8)")
    t0 = time.perf_counter()
    try:
        dims = load_model(args.model)
        src, dst = ParallelLayout.parse(args.source), ParallelLayout.parse(args.to)
        shape = dims.shape()
        src.check_fits(shape)
        dst.check_fits(shape)
    except (KeyError, LayoutError) as e:
        raise CLIError(str(e).strip("'\"")) from None
    distopt = distributed_optimizer(args)
    run = dry_run(dims, src, dst, distopt, args.gpus_per_node)
    reads = list(run.read_bytes.values())
    report = {
        "model": args.model, "from": src.to_json(), "to": dst.to_json(), "distributed_optimizer": distopt,
        "state_bytes": run.state_bytes, "bytes_total": sum(reads), "bytes_per_rank_max": max(reads),
        "bytes_per_rank_mean": sum(reads) / len(reads),
        "bytes_cross_node": sum(run.cross_node.values()) if run.cross_node is not None else None,
        "central_bytes_through_one_rank": run.central_bytes,
    }
    total_seconds = time.perf_counter() - t0  # the catalogue look-up, both layouts, the plan and every total
    report.update({"describe_seconds": total_seconds - run.plan_seconds, "plan_seconds": run.plan_seconds,
                   "total_seconds": total_seconds})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    state = run.state_bytes
    print(f"plan         {args.model}: {src} -> {dst}  ({src.world_size} -> {dst.world_size} GPUs, distributed optimizer: {distopt})")
    print(f"state        {fmt_bytes(state)} (bf16 weights, fp32 main weights and Adam moments)")
    print(f"read total   {fmt_bytes(report['bytes_total'])}  (every DP replica loads its weights)")
    print(f"per rank     max {fmt_bytes(report['bytes_per_rank_max'])}, mean {fmt_bytes(report['bytes_per_rank_mean'])}")
    if args.gpus_per_node:
        print(f"cross-node   {fmt_bytes(report['bytes_cross_node'])} ({args.gpus_per_node} GPUs per node, sources at their writers)")
    print(f"central      {fmt_bytes(report['central_bytes_through_one_rank'])} through one rank (gather all, scatter all): "
          f"{report['central_bytes_through_one_rank'] / report['bytes_per_rank_max']:.0f}x tenplex's busiest rank")
    print(f"time         {total_seconds:.2f} s: describe both layouts {report['describe_seconds']:.2f} s, "
          f"plan and totals {run.plan_seconds:.2f} s")
    return 0


def plan_report(plan: Any, source: PTC, dst: ParallelLayout, gpus_per_node: int | None, seconds: float) -> dict[str, Any]:
    per_rank = plan.bytes_per_rank()
    cross = 0
    if gpus_per_node:
        for r, rp in plan.ranks.items():
            node = r // gpus_per_node
            for p in rp.pieces:
                sc = plan.sources[p.source]
                if sc.location.rank // gpus_per_node != node:
                    cross += p.numel * dtype_size(source.tensors[sc.chunk.key].dtype)
    vals = list(per_rank.values()) or [0]
    return {
        "state_bytes": source.total_bytes(),
        "distinct_state_bytes": source.distinct_bytes(),
        "bytes_total": sum(vals),
        "bytes_per_rank_max": max(vals),
        "bytes_per_rank_mean": sum(vals) / len(vals),
        "bytes_cross_node": cross,
        "bytes_per_rank": {str(r): b for r, b in per_rank.items()},
        "plan_seconds": seconds,
    }


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand and its flags."""
    q = sub.add_parser("plan", help="dry run: bytes each destination rank would read for a new layout")
    q.add_argument("checkpoint", nargs="?", help="checkpoint directory (or use --model and --from)")
    q.add_argument("--from", dest="source", help="source layout with --model")
    q.add_argument("--to", required=True, help="destination layout, e.g. tp=2,pp=2,dp=1")
    add_job_options(q, ("model", "gpus_per_node", "distributed_optimizer"))
    q.add_argument("--vocab-padding", choices=["keep", "megatron"], default="keep")
    q.add_argument("--per-rank", action="store_true")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_plan)
