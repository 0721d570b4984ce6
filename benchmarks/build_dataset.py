"""Throughput of scripts/build_dataset.py (documents/s, tokens/s, MB/s), and of Megatron-LM's
tools/preprocess_data.py on the same input where a checkout is given (``MEGATRON_LM_PATH`` or ``--megatron-lm``).

The input is ``--mb`` MB of generated English-like JSON lines (``tests/tokenizer_files.training_text``, 8 lines
per document); the tokenizers are a byte-level BPE of ``--vocab`` tokens trained on part of it by the
``tokenizers`` library, read as GPT2BPETokenizer (vocab.json + merges.txt) and as HuggingFaceTokenizer (its
directory), plus the byte-level default. build_dataset runs in this process (``build_indexed_dataset``, the
code behind the script) with each ``--workers`` count; preprocess_data.py runs as its own process with the
same count (GPT-2 through its legacy tokenizer, which reads local files; Hugging Face through its default
system). Rates leave set-up out on both sides (preprocess_data.py's own "Processed N documents" line is
read, its ``--log-interval`` set to the document count), and both outputs must be identical byte for byte.

Output: a table, ``RATIO docs_per_s <tokenizer> w<N> build_dataset/preprocess_data = X.XX`` lines (above 1:
build_dataset is faster) and JSON (``--json``).

    python -m benchmarks.build_dataset --mb 4 --workers 1 2
    MEGATRON_LM_PATH=/path/to/Megatron-LM python -m benchmarks.build_dataset --mb 4 --workers 1 2 --json b.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from tenplex_megatron.training.dataset_builder import build_indexed_dataset, json_documents
from tenplex_megatron.training.progress import Progress
from tenplex_megatron.training.tokenizer import TokenizerSpec
from tests.tokenizer_files import make_tokenizer_files, training_text

PROCESSED = re.compile(r"Processed (\d+) documents \(([0-9.e+]+) docs/s, ([0-9.e+]+) MB/s\)")


def write_corpus(path: str, mb: float, seed: int = 0) -> tuple[int, int]:
    """``mb`` MB of JSON lines, 8 generated lines per document; returns (documents, bytes)."""
    docs = size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            lines = training_text(8, seed=seed + docs)
            line = json.dumps({"text": "\n".join(lines)}, ensure_ascii=False) + "\n"
            f.write(line)
            docs, size = docs + 1, size + len(line.encode())
    return docs, size


def ours(src: str, out: str, spec: TokenizerSpec, workers: int) -> dict:
    r = build_indexed_dataset(json_documents(src), out, spec, workers=workers, progress=Progress(every=0))
    return {"docs": r.documents, "tokens": r.tokens, "seconds": r.seconds, "docs_per_s": r.docs_per_s,
            "tokens_per_s": r.tokens_per_s, "MB_per_s": r.input_bytes / 1e6 / r.seconds}


def theirs(mlm: str, src: str, out: str, flags: list[str], workers: int, docs: int, tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (mlm, os.environ.get("PYTHONPATH", "")) if p),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.join(mlm, "tools", "preprocess_data.py"), "--input", src,
                        "--output-prefix", out, "--workers", str(workers), "--append-eod", "--log-interval", str(docs),
                        *flags], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed:\n{(p.stdout + p.stderr)[-3000:]}")
    m = PROCESSED.findall(p.stderr)
    if not m or int(m[-1][0]) != docs:
        raise SystemExit(f"preprocess_data.py printed no rate for {docs} documents:\n{p.stderr[-3000:]}")
    n, dps, mbps = int(m[-1][0]), float(m[-1][1]), float(m[-1][2])
    seconds = n / dps
    return {"docs": n, "tokens": tokens, "seconds": seconds, "docs_per_s": dps, "tokens_per_s": tokens / seconds,
            "MB_per_s": mbps * 1024 * 1024 / 1e6, "wall_s_with_startup": wall}


def same_files(a: str, b: str) -> bool:
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as x, open(b + ext, "rb") as y:
            if x.read() != y.read():
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="MB of generated JSON lines")
    ap.add_argument("--vocab", type=int, default=800, help="BPE vocabulary trained for the GPT-2 / HF tokenizers")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    ap.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"), help="a Megatron-LM checkout")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    work = a.workdir or tempfile.mkdtemp(prefix="bench_build_dataset_")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "corpus.jsonl")
    docs, size = write_corpus(src, a.mb)
    tok = make_tokenizer_files(os.path.join(work, "tok"), a.vocab, texts=training_text(4000, seed=123))
    specs = {
        "ByteLevel": (TokenizerSpec(), None),
        "GPT2BPETokenizer": (TokenizerSpec("GPT2BPETokenizer", vocab_file=tok.vocab_file, merge_file=tok.merge_file),
                             ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tok.vocab_file, "--merge-file",
                              tok.merge_file, "--legacy-tokenizer"]),
        "HuggingFaceTokenizer": (TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=tok.hf_dir),
                                 ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok.hf_dir]),
    }
    print(f"input: {src}: {docs} documents, {size / 1e6:.2f} MB; BPE vocabulary {a.vocab}; "
          f"Megatron-LM: {a.megatron_lm or 'not given'}", flush=True)
    results: dict = {"input": {"documents": docs, "bytes": size, "vocab": a.vocab}, "runs": []}
    print(f"{'tokenizer':22s} {'tool':16s} {'workers':>7s} {'docs/s':>10s} {'tokens/s':>12s} {'MB/s':>7s} {'s':>7s}")
    failed = False
    for name, (spec, flags) in specs.items():
        for w in a.workers:
            out = os.path.join(work, f"ours_{name}_w{w}")
            mine = ours(src, out, spec, w)
            rows = [("build_dataset", mine)]
            if a.megatron_lm and flags is not None:
                theirs_out = os.path.join(work, f"mlm_{name}_w{w}")
                other = theirs(a.megatron_lm, src, theirs_out, flags, w, docs, mine["tokens"])
                other["identical"] = same_files(out, theirs_out + "_text_document")
                failed |= not other["identical"]
                rows.append(("preprocess_data", other))
            for tool, r in rows:
                print(f"{name:22s} {tool:16s} {w:7d} {r['docs_per_s']:10.1f} {r['tokens_per_s']:12.1f} "
                      f"{r['MB_per_s']:7.2f} {r['seconds']:7.2f}" + ("" if "identical" not in r else
                                                                  f"  identical: {r['identical']}"), flush=True)
                results["runs"].append({"tokenizer": name, "tool": tool, "workers": w, **r})
            if len(rows) == 2:
                print(f"RATIO docs_per_s {name} w{w} build_dataset/preprocess_data = "
                      f"{mine['docs_per_s'] / rows[1][1]['docs_per_s']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed:
        print("OUTPUT DIFFERS from preprocess_data.py's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
