"""Build a Megatron indexed dataset (<out>.bin / <out>.idx) with the byte-level tokenizer.

    python scripts/build_dataset.py --input docs/ notes.txt --out data/corpus     # one document per file
    python scripts/build_dataset.py --generate 2000 --out data/generated          # built-in learnable corpus

The generated corpus is deterministic (``--seed``): short templated English
sentences with counting and arithmetic, so a small model visibly learns it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Leslie", "Frances"]
THINGS = ["apples", "books", "GPUs", "servers", "tensors", "layers", "nodes", "tokens"]


def generated_documents(n: int, seed: int) -> list[str]:
    """``n`` short, learnable documents."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        start = rng.randint(0, 50)
        count = " ".join(str(start + i) for i in range(8))
        docs.append(f"{who} has {a} {what} and gets {b} more, so {who} has {a + b} {what}. Counting: {count}.")
    return docs


def text_documents(paths: list[str]) -> list[str]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".txt"))
        else:
            files.append(p)
    docs = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            docs.append(fh.read())
    return docs


def build(docs: list[str], out: str) -> tuple[str, int]:
    """Write ``out.bin``/``out.idx``; returns the prefix and the number of tokens."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tenplex_megatron.integrations.data import ByteTokenizer

    tok = ByteTokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    builder = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    tokens = 0
    for d in docs:
        ids = np.append(tok.tokenize(d), tok.eod)
        builder.add_item(torch.from_numpy(ids.astype(np.int64)))
        builder.end_document()
        tokens += len(ids)
    builder.finalize(out + ".idx")
    return out, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="*", default=[], help="text files or directories of .txt files")
    ap.add_argument("--generate", type=int, default=0, help="number of generated documents")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    a = ap.parse_args()
    docs = text_documents(a.input) + generated_documents(a.generate, a.seed)
    if not docs:
        ap.error("give --input files or --generate N")
    prefix, tokens = build(docs, a.out)
    print(f"{prefix}.bin/.idx: {len(docs)} documents, {tokens} tokens (byte-level, vocab 258)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
