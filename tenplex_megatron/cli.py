"""``python -m tenplex_megatron``: inspect or verify a checkpoint, dry-run a re-shard plan, rank layouts. Never imports
torch (tested).

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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tenplex_megatron import __version__, cli_simulate
from tenplex_megatron._optional import require
from tenplex_megatron.cli_options import add_job_options, distributed_optimizer, gpus_per_node
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.memory import node_dir
from tenplex_megatron.plan.autolayout import (
    GIB,
    Hardware,
    LayoutCandidate,
    describe_refused,
    rank_layouts,
    total_parameters,
)
from tenplex_megatron.plan.experts import expert_summary
from tenplex_megatron.plan.hf_map import HFMapError, parse_size
from tenplex_megatron.plan.layout import (
    LayoutError,
    ModelShape,
    ParallelLayout,
    padded_vocab_size,
    restart_padded_vocab_size,
)
from tenplex_megatron.plan.layout_files import read_layout_times
from tenplex_megatron.plan.planner import PlanError, plan_reshard
from tenplex_megatron.plan.ptc import PTC, PTCError, dtype_size
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import load_model
from tenplex_megatron.plan.sim.sharding import layout_chunks, resize_vocab
from tenplex_megatron.storage import copies
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata, missing_shape
from tenplex_megatron.storage.confine import confine, confine_all
from tenplex_megatron.storage.directory import (
    find_checkpoint,
    find_megatron_checkpoint,
    is_legacy_megatron_checkpoint,
    read_checkpoint_metadata,
)
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.megatron_legacy import describe_legacy, legacy_model_metas
from tenplex_megatron.storage.megatron_ptc import describe_torch_dist, index_model_metas, read_torch_dist
from tenplex_megatron.storage.megatron_summary import read_common, read_torch_pickle, summarize, summarize_legacy
from tenplex_megatron.storage.verify_ckpt import CheckReport, checkpoints_in, default_workers, verify_checkpoint


class CLIError(TenplexError, RuntimeError):
    """A bad argument, or a checkpoint or directory a command cannot use: printed without a traceback, exit 2."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def _load(path: str) -> tuple[str, CheckpointMetadata, PTC]:
    """The tenplex checkpoint under ``path``, its metadata checked field by field (a bad one: one error line)."""
    try:
        ckpt, _ = copies.choose(path)  # every copy damaged: an error naming each
    except CheckpointFileError as e:
        raise CLIError(str(e)) from None
    if ckpt is None:
        raise CLIError(f"{path}: no complete tenplex checkpoint here")
    try:
        meta = read_checkpoint_metadata(ckpt)
        ptc = meta.require_ptc()
        confine_all(ckpt, (sc.location.file for sc in ptc.chunks))
    except (CheckpointFileError, PTCError) as e:
        raise CLIError(f"{ckpt}: {e}") from None
    return ckpt, meta, ptc


@dataclass(frozen=True)
class _Saved:
    """What ``plan`` needs of a checkpoint's record, tenplex's or Megatron's own."""

    layout: Mapping[str, int]
    distributed_optimizer: bool
    padded_vocab_size: int | None
    framework: str | None = None


def _megatron(path: str) -> str | None:
    """Megatron's own checkpoint under ``path`` when there is no tenplex one."""
    if find_checkpoint(path) is not None:
        return None
    try:
        return find_megatron_checkpoint(path)
    except (CheckpointFileError, OSError):
        return None


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
    print(f"bytes        {_fmt_bytes(summary['bytes'])} in {len(summary['files'])} files")
    if args.tensors:
        width = max(len(k) for k in table)
        print(f"\n{'tensor':<{width}}  {'shape':<18} {'dtype':<9} {'chunks':>6}")
        for k, t in table.items():
            print(f"{k:<{width}}  {str(t['shape']):<18} {t['dtype']:<9} {t['chunks']:>6}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if (mck := _megatron(args.checkpoint)) is not None:
        return _inspect_megatron(mck, args)
    ckpt, meta, ptc = _load(args.checkpoint)
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
    print(f"bytes        {_fmt_bytes(summary['bytes'])} in {len(summary['files'])} files")
    if args.tensors:
        width = max(len(k) for k in ptc.tensors)
        print(f"\n{'tensor':<{width}}  {'shape':<18} {'dtype':<9} {'chunks':>6} {'bytes':>12}")
        for k, t in ptc.tensors.items():
            print(f"{k:<{width}}  {str(list(t.global_shape)):<18} {t.dtype:<9} {per_tensor[k][0]:>6} "
                  f"{_fmt_bytes(per_tensor[k][1]):>12}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.model:
        return _plan_model(args)
    if not args.checkpoint:
        raise CLIError("plan needs a checkpoint directory, or --model NAME --from LAYOUT")
    t_read = time.perf_counter()
    if (mck := _megatron(args.checkpoint)) is not None:
        ckpt, saved, source, shape = _describe_megatron(mck)
    else:
        ckpt, meta, source = _load(args.checkpoint)
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
    plan = _plan_to(source, dst, distopt, padded)
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
        f" stored, {_fmt_bytes(report['distinct_state_bytes'])} of it distinct (the rest: copies it keeps of replicas)"
    print(f"state        {_fmt_bytes(report['state_bytes'])}{copies}")
    print(f"read total   {_fmt_bytes(report['bytes_total'])}  "
          f"(per rank max {_fmt_bytes(report['bytes_per_rank_max'])}, mean {_fmt_bytes(report['bytes_per_rank_mean'])})")
    if args.gpus_per_node:
        print(f"cross-node   {_fmt_bytes(report['bytes_cross_node'])} "
              f"({args.gpus_per_node} GPUs per node; peer-to-peer transfer)")
    print(f"time         {(read_seconds + seconds) * 1000:.1f} ms: read the checkpoint's metadata "
          f"{read_seconds * 1000:.1f} ms, plan and totals {seconds * 1000:.1f} ms")
    if args.per_rank:
        for r, b in report["bytes_per_rank"].items():
            print(f"  rank {r:>5}: {_fmt_bytes(b)}")
    return 0


def _plan_to(source: PTC, dst: ParallelLayout, distopt: bool, padded: int) -> Any:
    """The plan from ``source`` to ``dst`` (every element covered exactly once), or the reasons it cannot be."""
    try:
        tensors = resize_vocab(source.tensors, padded)
        chunks = layout_chunks(tensors, dst, distopt)
        return plan_reshard(source, tensors, chunks, strict=True)
    except (LayoutError, PlanError) as e:
        raise CLIError(str(e)) from None


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
    print(f"state        {_fmt_bytes(state)} (bf16 weights, fp32 main weights and Adam moments)")
    print(f"read total   {_fmt_bytes(report['bytes_total'])}  (every DP replica loads its weights)")
    print(f"per rank     max {_fmt_bytes(report['bytes_per_rank_max'])}, mean {_fmt_bytes(report['bytes_per_rank_mean'])}")
    if args.gpus_per_node:
        print(f"cross-node   {_fmt_bytes(report['bytes_cross_node'])} ({args.gpus_per_node} GPUs per node, sources at their writers)")
    print(f"central      {_fmt_bytes(report['central_bytes_through_one_rank'])} through one rank (gather all, scatter all): "
          f"{report['central_bytes_through_one_rank'] / report['bytes_per_rank_max']:.0f}x tenplex's busiest rank")
    print(f"time         {total_seconds:.2f} s: describe both layouts {report['describe_seconds']:.2f} s, "
          f"plan and totals {run.plan_seconds:.2f} s")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None


def cmd_layouts(args: argparse.Namespace) -> int:
    """Every (TP, PP, DP, micro-batch) for --gpus, ranked, with estimates; each excluded one with its reasons."""
    try:
        dims = load_model(args.model)
    except KeyError as e:
        raise CLIError(str(e).strip("'\"")) from None
    args.gpus_per_node, args.distributed_optimizer = gpus_per_node(args), distributed_optimizer(args)
    hardware = Hardware(flops_per_gpu=args.tflops_per_gpu * 1e12)
    try:
        measured = read_layout_times(args.times).get(args.gpus, {}) if args.times else {}
        ranking = rank_layouts(dims, args.gpus, args.gpus_per_node, args.global_batch_size, memory_gb=args.memory_gb,
                               micro_batch_sizes=args.micro_batch_sizes, measured=measured, hardware=hardware,
                               distributed_optimizer=args.distributed_optimizer, flash_attention=args.flash_attention,
                               sequence_parallel=args.sequence_parallel)
    except LayoutError as e:
        raise CLIError(str(e)) from None
    usable = [c for c in ranking if c.usable]
    shown = usable[: args.top] if args.top else usable
    if args.json:
        print(json.dumps({
            "model": args.model, "parameters": total_parameters(dims), "world_size": args.gpus,
            "gpus_per_node": args.gpus_per_node, "global_batch_size": args.global_batch_size,
            "memory_gib": args.memory_gb, "distributed_optimizer": args.distributed_optimizer,
            "sequence_parallel": args.sequence_parallel,
            "flops_per_gpu": hardware.flops_per_gpu, "best": usable[0].key if usable else None,
            "candidates": [{**c.to_json(), **({"expert_tp": c.layout.expert_tp, "expert_dp": c.layout.expert_dp}
                                              if dims.num_experts else {})} for c in ranking],
        }, indent=1))
    else:
        _print_layouts(args, dims.bf16, total_parameters(dims), hardware, ranking, shown, bool(dims.num_experts))
    if not usable:
        raise CLIError(f"no usable layout for {args.gpus} GPUs: every candidate is refused (reasons above)")
    return 0


def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _print_layouts(args: argparse.Namespace, bf16: bool, params: int, hw: Hardware,
                   ranking: tuple[LayoutCandidate, ...], shown: list[LayoutCandidate], moe: bool = False) -> None:
    """The ranking as a table; for a mixture of experts with each candidate's expert TP x EP x expert DP (the key
    names expert TP only where it differs from TP) and the EP and expert TP communication."""
    budget = f"{args.memory_gb:g} GiB per rank" if args.memory_gb else "no memory limit"
    print(f"layouts      {args.model} ({_fmt_count(params)} parameters, {'bf16' if bf16 else 'fp32'}) on {args.gpus} "
          f"GPUs, {args.gpus_per_node} per node; global batch {args.global_batch_size}; {budget}; "
          f"distributed optimizer: {args.distributed_optimizer}; sequence parallelism: {args.sequence_parallel}")
    print(f"model        {hw.flops_per_gpu / 1e12:g} TFLOP/s per GPU, {hw.intra_node_bandwidth / 1e9:g} GB/s within a "
          f"node, {hw.inter_node_bandwidth / 1e9:g} GB/s between nodes (tenplex_megatron/plan/autolayout.py)")
    usable = sum(c.usable for c in ranking)
    print(f"candidates   {len(ranking)}: {usable} usable, {len(ranking) - usable} excluded")
    if moe:
        print("experts      ETPxEPxEDP: expert TP x EP x expert DP" + ("" if args.sequence_parallel else
              "; TP 1 only: megatron-core needs --sequence-parallel with MoE at TP > 1"))
    width, head = (38, f"{'ETPxEPxEDP':>12} ") if moe else (24, "")
    if shown:
        print(f"\n{'#':>3}  {'layout':<{width}} {head}{'micro-batches':>13}  "
              f"{'memory/rank':>11}  {'(weights+grads+optim+activ)':<27}  {'s/iter':>8}  "
              f"(bubble, TP, PP, DP{', EP, expert TP' if moe else ''} comm)")
    for i, c in enumerate(shown, 1):
        mem, t = c.memory, c.modelled
        assert mem is not None and t is not None
        parts = "+".join(f"{x / GIB:.1f}" for x in (mem.weights, mem.gradients, mem.optimizer, mem.activations))
        comm = ", ".join(f"{x:.2f}" for x in (t.bubble, t.tp_comm, t.pp_comm, t.dp_comm,
                                              *((t.ep_comm, t.etp_comm) if moe else ())))
        how = "measured" if c.measured_seconds is not None else "modelled"
        lay = c.layout
        experts = f"{f'{lay.expert_tp}x{lay.ep}x{lay.expert_dp}':>12} " if moe else ""
        print(f"{i:>3}  {c.key:<{width}} {experts}{c.num_microbatches:>13}  {mem.total / GIB:>7.2f} GiB  {parts:<27}  "
              f"{c.seconds:>8.3f}  ({comm}) {how}")
    if len(shown) < usable:
        print(f"     ... {usable - len(shown)} more usable (--top 0 shows all)")
    refused = describe_refused(ranking)
    if refused:
        print(f"\nexcluded ({len(ranking) - usable} candidates):")
        print("\n".join(refused))


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
        line = (f"verify: {self.name}: {_fmt_bytes(done)} of {_fmt_bytes(total)} ({100 * done / max(total, 1):.0f}%), "
                f"{rate / 1e9:.2f} GB/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.tty and self.shown:
            print(file=sys.stderr)


def _print_report(r: CheckReport) -> None:
    it = f"iteration {r.iteration}, " if r.iteration is not None else ""
    what = (f"{it}{r.files} files, {r.tensors} tensors in {r.chunks} stored chunks, "
            f"{_fmt_bytes(r.bytes_checked)} read, {r.blocks} checksums in {r.seconds:.2f} s "
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
              f"{_fmt_bytes(checked)} checked in {seconds:.2f} s ({checked / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    return 1 if bad else 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Export a checkpoint as a Hugging Face model (torch and transformers are imported only here)."""
    try:
        max_shard = parse_size(args.max_shard_size)
        if find_checkpoint(args.checkpoint) is None:
            raise CLIError(f"{args.checkpoint}: no complete tenplex checkpoint here")
        export = require("tenplex_megatron.integrations.hf.export", "hf", needed_by="export-hf")
        res = export.export_hf(args.checkpoint, args.out, args.dtype, max_shard, args.force)
    except (HFMapError, PlanError, PTCError, CheckpointFileError, FileExistsError) as e:
        raise CLIError(str(e)) from None
    print(f"export-hf: {res.arch} model, {res.tensors} tensors, {_fmt_bytes(res.bytes)} in {len(res.files)} "
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
    ckpt, meta, source = _load(args.checkpoint)
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
    _plan_to(source, dst, distopt, padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, dst.tp))
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
    p = argparse.ArgumentParser(prog="python -m tenplex_megatron", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tenplex-megatron {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="layout, tensors, bytes and iteration of a checkpoint")
    i.add_argument("checkpoint")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)
    v = sub.add_parser("verify", help="read every stored chunk and check its checksums, file sizes and the "
                                      "tensors' partition, without a model (exit 1 naming what is damaged)")
    v.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest checkpoint)")
    v.add_argument("--all", action="store_true", help="every checkpoint under the save directory")
    v.add_argument("--json", action="store_true")
    v.add_argument("--workers", type=int, default=None, help="reading threads (default: the CPUs available)")
    v.add_argument("--progress-every", type=float, default=None, help=argparse.SUPPRESS)  # seconds between lines
    v.set_defaults(fn=cmd_verify)
    q = sub.add_parser("plan", help="dry run: bytes each destination rank would read for a new layout")
    q.add_argument("checkpoint", nargs="?", help="checkpoint directory (or use --model and --from)")
    q.add_argument("--from", dest="source", help="source layout with --model")
    q.add_argument("--to", required=True, help="destination layout, e.g. tp=2,pp=2,dp=1")
    add_job_options(q, ("model", "gpus_per_node", "distributed_optimizer"))
    q.add_argument("--vocab-padding", choices=["keep", "megatron"], default="keep")
    q.add_argument("--per-rank", action="store_true")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_plan)
    la = sub.add_parser("layouts", help="rank every TP/PP/DP/micro-batch for a GPU count: memory, modelled time, "
                                        "why a layout is excluded")
    la.add_argument("--gpus", type=int, required=True, help="world size: the number of GPUs (processes)")
    add_job_options(la, required=("model",))
    la.add_argument("--micro-batch-sizes", type=_int_list, default=[1, 2, 4, 8],
                    help="micro-batch sizes to try, comma-separated (default 1,2,4,8)")
    la.add_argument("--times", help="measured iteration times (JSON written by --tenplex-layout measure)")
    la.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="the job runs without --sequence-parallel: part of each layer's activations stays whole on "
                         "every TP rank, and a mixture of experts stays at TP 1")
    la.add_argument("--flash-attention", action="store_true",
                    help="no stored attention scores (FlashAttention or selective recomputation) in the memory estimate")
    la.add_argument("--top", type=int, default=0, help="print only the best N usable candidates (0: all)")
    la.add_argument("--json", action="store_true")
    la.set_defaults(fn=cmd_layouts)
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
    cm = sub.add_parser("clean-memory", help="remove the host-memory snapshots (--tenplex-memory) a finished job "
                                             "left in a node's memory directory")
    cm.add_argument("directory")
    cm.set_defaults(fn=cmd_clean_memory)
    cli_simulate.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CLIError, cli_simulate.SimulateError) as e:
        print(f"tenplex_megatron: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as a Unix filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
