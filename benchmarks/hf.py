"""Hugging Face export and import through tenplex against the plain route, time and peak memory, in one run.

    python -m benchmarks.hf [--quick] [--models gpt3-1.3b llama-1b] [--tp 2 --pp 2] [--dtype bf16] [--workdir DIR]

For each model (random weights; built with transformers' own config classes
and written with ``save_pretrained``):

- plain: ``AutoModelForCausalLM.from_pretrained`` of the whole model, then
  ``save_pretrained`` (what a conversion script does in or out);
- tenplex export: ``export_hf`` of a tenplex checkpoint saved at TP x PP
  (TP-split chunks, fused per-group QKV) to a transformers directory;
- tenplex import: each rank of a TP x PP job plans and reads only its slice of
  the transformers directory through the planner (``open_hf``, the executor),
  into freshly allocated tensors; ranks run one after another here, each in a
  fresh process, and the figures are the slowest and the largest rank's (a
  job's ranks run at once). Building the megatron model is not included.

Every measured step runs in a fresh process (peak RSS and anonymous memory
sampled every 5 ms, above the process's baseline after its imports).
transformers memory-maps safetensors, so the plain route's weights are
file-backed pages: compare its RSS, not its anonymous memory. Prints a table and RATIO lines (tenplex over plain: below
1, tenplex is better). ``--quick``: tiny shapes, every step in this process (what the smoke test
runs: quick, its memory figures rough).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from benchmarks.kit.disk import dir_size
from benchmarks.kit.launch import ROOT
from benchmarks.kit.memory import PeakRSS, release_memory
from benchmarks.kit.report import ratio_key, ratio_line

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # GPT-3 1.3B (Brown et al., table 2.1) as a GPT-2 architecture
    "gpt3-1.3b": ("GPT2Config", {"n_layer": 24, "n_embd": 2048, "n_head": 16, "n_positions": 2048,
                                 "vocab_size": 50257}),
    # Llama 3.2 1B's shape
    "llama-1b": ("LlamaConfig", {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                                 "max_position_embeddings": 2048, "tie_word_embeddings": True,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "gpt2-tiny": ("GPT2Config", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 100}),
    "llama-tiny": ("LlamaConfig", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
                                   "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100,
                                   "max_position_embeddings": 64, "tie_word_embeddings": False}),
}
COMMON = {"GPT2Config": {"activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                         "bos_token_id": None, "eos_token_id": None},
          "LlamaConfig": {"bos_token_id": None, "eos_token_id": None}}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


# ---- steps, each run in a fresh process -------------------------------------------------------------------------

def step_make(model: str, dtype: str, out: str) -> dict[str, Any]:
    torch, transformers = _lib().torch, _lib().transformers
    cls_name, kw = MODELS[model]
    cfg = getattr(transformers, cls_name)(**kw, **COMMON[cls_name])
    torch.set_default_dtype(getattr(torch, DTYPES[dtype]))
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    m.save_pretrained(out)
    return {"params": sum(p.numel() for p in m.parameters())}


def step_plain(src: str, out: str, dtype: str) -> dict[str, Any]:
    torch, transformers = _lib().torch, _lib().transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, DTYPES[dtype]))
    m.save_pretrained(out)
    return {}


def _rank_boxes(mapping: Any, padded: int, tp: int, pp: int, rank: int) -> list[Any]:
    """Rank ``rank``'s boxes of a TP x PP megatron-core job (TP fastest), as megatron-core shards them."""
    Chunk = _lib().Chunk  # noqa: N806 (the class)
    t, p = rank % tp, rank // tp
    out = []
    for key, m in mapping.megatron.items():
        shape = list(m.shape)
        if m.vocab_rows is not None:
            shape[0] = padded
        off = [0] * len(shape)
        if key.startswith("decoder.layers."):
            per = shape[0] // pp
            off[0], shape[0] = p * per, per
        elif key.startswith("embedding.") and p != 0:
            continue
        elif (key.startswith("output_layer") or key.startswith("decoder.final")) and p != pp - 1:
            continue
        leaf = key.rsplit(".", 1)[0]
        axis = None
        if m.vocab_rows is not None or leaf.endswith(("linear_qkv", "linear_fc1")) and "layer_norm" not in key:
            axis = 0 if m.vocab_rows is not None else 1
        elif leaf.endswith(("linear_proj", "linear_fc2")) and key.endswith(".weight"):
            axis = 2
        parts = 2 if (leaf.endswith("linear_fc1") and mapping.arch == "llama" and axis) else 1
        if axis is None:
            out.append(Chunk(key, tuple(off), tuple(shape)))
            continue
        size = shape[axis] // parts
        n = size // tp
        for part in range(parts):
            o, s = list(off), list(shape)
            o[axis], s[axis] = part * size + t * n, n
            out.append(Chunk(key, tuple(o), tuple(s)))
    return out


def _import_rank(hf_dir: str, tp: int, pp: int, rank: int, fill: list | None = None) -> tuple[list, list, int]:
    """Plan and read rank ``rank``'s slice of the transformers directory; returns (chunks, tensors, bytes read)."""
    lib = _lib()
    opened = lib.open_hf(hf_dir)
    facts, mapping, padded = _job_mapping(opened.metadata.raw["config"], tp)
    chunks = _rank_boxes(mapping, padded, tp, pp, rank)
    dst = {k: lib.TensorMeta(k, (padded, *m.shape[1:]) if m.vocab_rows else m.shape, opened.ptc.tensors[k].dtype,
                             vocab_rows=m.vocab_rows) for k, m in mapping.megatron.items()}
    plan = lib.plan_reshard(opened.ptc, dst, {rank: chunks}, strict=False)
    mine = plan.ranks[rank]
    lib.prepare_sources(mine, plan.sources, opened.files)
    tensors = [lib.torch.empty(c.numel, dtype=lib.TORCH_DTYPES[dst[c.key].dtype]) for c in chunks]
    stats = lib.execute_plan(mine, plan.sources, opened.files, tensors)
    opened.files.close()
    return chunks, tensors, stats.bytes_read


def _job_mapping(config: dict[str, Any], tp: int) -> tuple[Any, Any, int]:
    """The transformers config's model facts, its megatron-core mapping and the padded vocabulary at ``tp``."""
    lib = _lib()
    facts = lib.facts_from_hf_config(config)
    return facts, lib.build_mapping(facts), lib.padded_vocab_size(facts.vocab_size, 128, tp)


def step_import(hf_dir: str, tp: int, pp: int, rank: int) -> dict[str, Any]:
    _, tensors, read = _import_rank(hf_dir, tp, pp, rank)
    return {"bytes_read": read, "bytes_held": sum(t.numel() * t.element_size() for t in tensors)}


def step_tenplex_ckpt(hf_dir: str, tp: int, pp: int, out: str) -> dict[str, Any]:
    """A tenplex checkpoint of the whole TP x PP job (every rank's chunks, saved by one process: setup only)."""
    lib = _lib()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    lib.dist.init_process_group("gloo")
    facts, mapping, padded = _job_mapping(lib.read_hf_dir(hf_dir).config, tp)
    seen: set = set()
    local: list[Any] = []
    for r in range(tp * pp):
        chunks, tensors, _ = _import_rank(hf_dir, tp, pp, r)
        for c, t in zip(chunks, tensors):
            if (c.key, c.offsets) in seen:
                continue
            seen.add((c.key, c.offsets))
            m = mapping.megatron[c.key]
            shape = (padded, *m.shape[1:]) if m.vocab_rows else m.shape
            meta = lib.TensorMeta(c.key, shape, lib.torch_dtype_name(t.dtype), vocab_rows=m.vocab_rows)
            local.append(lib.LocalChunk(meta, c, t.view(c.shape), True))
    doc = {"framework": "megatron-core", "model": facts.to_model_json(), "padded_vocab_size": padded}
    lib.save_chunks(local, out, 0, {"tp": tp, "pp": pp, "dp": 1}, {}, lambda infos: doc)
    lib.dist.destroy_process_group()
    return {}


def step_export(ckpt: str, out: str) -> dict[str, Any]:
    res = _lib().export_hf(ckpt, out, max_shard_bytes=2 * 10**9)
    return {"largest_tensor_bytes": res.largest_tensor_bytes, "bytes": res.bytes}


STEPS = {"make": step_make, "plain": step_plain, "import": step_import, "tenplex-ckpt": step_tenplex_ckpt,
         "export": step_export}


FRESH = True  # each step in a fresh process (--quick: all in this one, for speed: its memory figures are rough)


@functools.cache
def _lib() -> SimpleNamespace:
    """Everything the steps use, imported once per process at the first call (the parent never imports torch or
    transformers: its baseline stays small); a fresh step's process calls it before it measures."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401 (imported before the measured work)
    from transformers.models.llama import modeling_llama  # noqa: F401

    from tenplex_megatron.engine.chunks import LocalChunk
    from tenplex_megatron.engine.save import save_chunks
    from tenplex_megatron.execute.executor import execute_plan, prepare_sources
    from tenplex_megatron.integrations.hf.export import export_hf
    from tenplex_megatron.integrations.hf.source import open_hf, read_hf_dir
    from tenplex_megatron.plan.hf_map import build_mapping, facts_from_hf_config
    from tenplex_megatron.plan.layout import padded_vocab_size
    from tenplex_megatron.plan.planner import plan_reshard
    from tenplex_megatron.plan.ptc import Chunk, TensorMeta
    from tenplex_megatron.storage.safetensors_io import TORCH_DTYPES, torch_dtype_name

    transformers.AutoModelForCausalLM  # noqa: B018 (resolve the lazy attribute)
    return SimpleNamespace(
        torch=torch, dist=dist, transformers=transformers, LocalChunk=LocalChunk, save_chunks=save_chunks,
        execute_plan=execute_plan, prepare_sources=prepare_sources, export_hf=export_hf, open_hf=open_hf,
        read_hf_dir=read_hf_dir, build_mapping=build_mapping, facts_from_hf_config=facts_from_hf_config,
        padded_vocab_size=padded_vocab_size, plan_reshard=plan_reshard, Chunk=Chunk, TensorMeta=TensorMeta,
        TORCH_DTYPES=TORCH_DTYPES, torch_dtype_name=torch_dtype_name)


def run_step(name: str, *args: Any) -> dict[str, Any]:
    """``name`` in a fresh process: its result, seconds and peak memory."""
    if not FRESH:
        return measure(name, list(args))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", __spec__.name, "_step", name, json.dumps(args)], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"step {name} {args} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child(name: str, args: list[Any]) -> None:
    """Import everything a step uses first, so its figures are the work alone (not module imports)."""
    _lib()
    print(json.dumps(measure(name, args)))


def measure(name: str, args: list[Any]) -> dict[str, Any]:
    release_memory()
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        out = STEPS[name](*args)
    return {**out, "seconds": time.perf_counter() - t0, **mem.record()}


# ---- the benchmark ------------------------------------------------------------------------------------------------

def check_same(a: str, b: str) -> None:
    """Every tensor of transformers directory ``b`` is bit-identical to ``a``'s (and no tensor is missing)."""
    import torch
    from safetensors.torch import load_file

    def tensors(path: str) -> dict[str, Any]:
        return {k: v for n in sorted(os.listdir(path)) if n.endswith(".safetensors")
                for k, v in load_file(os.path.join(path, n)).items()}

    ta, tb = tensors(a), tensors(b)
    if sorted(ta) != sorted(tb):
        raise SystemExit(f"round trip: tensor names differ: {sorted(set(ta) ^ set(tb))}")
    for k, v in ta.items():
        if tb[k].dtype != v.dtype or not torch.equal(tb[k], v):
            raise SystemExit(f"round trip: tensor {k!r} differs")
    print(f"round trip exact: {len(ta)} tensors of {a} equal bit for bit after a TP x PP tenplex checkpoint")


def bench_model(model: str, work: str, tp: int, pp: int, dtype: str) -> dict[str, Any]:
    d = os.path.join(work, model)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    hf, ckpt = os.path.join(d, "hf"), os.path.join(d, "ckpt")
    made = run_step("make", model, dtype, hf)
    run_step("tenplex-ckpt", hf, tp, pp, ckpt)
    plain = run_step("plain", hf, os.path.join(d, "plain"), dtype)
    shutil.rmtree(os.path.join(d, "plain"))
    export = run_step("export", ckpt, os.path.join(d, "export"))
    if not FRESH:  # --quick: the round trip transformers -> TP x PP tenplex checkpoint -> transformers is exact
        check_same(hf, os.path.join(d, "export"))
    shutil.rmtree(os.path.join(d, "export"))
    ranks = [run_step("import", hf, tp, pp, r) for r in range(tp * pp)]
    size = dir_size(hf)[0]
    shutil.rmtree(d)
    imp = {"seconds": max(r["seconds"] for r in ranks),
           "anon_peak": max(r["anon_peak"] - r["anon_before"] for r in ranks),
           "rss_peak": max(r["rss_peak"] - r["rss_before"] for r in ranks),
           "bytes_read": max(r["bytes_read"] for r in ranks)}
    return {"model": model, "params": made["params"], "bytes": size, "plain": plain, "export": export,
            "import": imp, "largest": export["largest_tensor_bytes"]}


def print_ratios(r: dict[str, Any]) -> None:
    m, plain = r["model"], r["plain"]
    for what, rec in (("export", r["export"]), ("import", r["import"])):
        print(ratio_line(ratio_key("seconds", f"{what} {m}", "tenplex", "plain"), rec["seconds"] / plain["seconds"]))
        anon = rec["anon_peak"] - rec.get("anon_before", 0)
        print(ratio_line(ratio_key("peak_anon", f"{what} {m}", "tenplex", "plain"),
                         anon / max(plain["anon_peak"] - plain["anon_before"], 1)))
        rss = rec["rss_peak"] - rec.get("rss_before", 0)
        print(ratio_line(ratio_key("peak_rss", f"{what} {m}", "tenplex", "plain"),
                         rss / max(plain["rss_peak"] - plain["rss_before"], 1)))
    export_anon = r["export"]["anon_peak"] - r["export"]["anon_before"]
    print(ratio_line(ratio_key("peak_anon", f"export {m}", "tenplex", "largest_tensor"), export_anon / r["largest"]),
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--workdir", default=None, help="where the models are written (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    global FRESH
    FRESH = not args.quick
    models = args.models or (["gpt2-tiny", "llama-tiny"] if args.quick else ["gpt3-1.3b", "llama-1b"])
    work = args.workdir or tempfile.mkdtemp(prefix="bench_hf_")
    results = []
    gb = 1e9
    print(f"tenplex vs plain transformers, TP={args.tp} x PP={args.pp} checkpoints, {args.dtype}; {os.cpu_count()} CPUs")
    print(f"{'model':<12} {'params':>8} {'size GB':>8} {'step':<16} {'seconds':>8} {'anon GB':>8} {'RSS GB':>8}")
    for model in models:
        r = bench_model(model, work, args.tp, args.pp, args.dtype)
        results.append(r)
        for step, rec in (("plain", r["plain"]), ("tenplex export", r["export"]), ("tenplex import*", r["import"])):
            anon = rec["anon_peak"] - rec.get("anon_before", 0)
            rss = rec["rss_peak"] - rec.get("rss_before", 0)
            print(f"{model:<12} {r['params'] / 1e6:>7.0f}M {r['bytes'] / gb:>8.3f} {step:<16} {rec['seconds']:>8.2f} "
                  f"{anon / gb:>8.3f} {rss / gb:>8.3f}", flush=True)
        print(f"{'':<12} largest tensor {r['largest'] / gb:.3f} GB; * slowest / largest of {args.tp * args.pp} ranks, "
              f"each reading {r['import']['bytes_read'] / gb:.3f} GB at most")
        print_ratios(r)  # per model, as soon as it is measured
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_step":
        _child(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
