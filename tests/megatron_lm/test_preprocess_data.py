"""Opt-in: scripts/build_dataset.py against Megatron-LM's own tools/preprocess_data.py, byte for byte.

Needs ``MEGATRON_LM_PATH`` (a core_v0.16.x checkout, never committed here; importing its tools needs
``six`` and ``triton``): ``MEGATRON_LM_PATH=/path/to/Megatron-LM pytest -m megatron_lm
tests/megatron_lm/test_preprocess_data.py``. The same JSON lines (an empty document, a list of sentences and
a literal ``<|endoftext|>`` among them) go through both with tokenizers the test trains:

- GPT2BPETokenizer (vocab.json + merges.txt) through Megatron-LM's legacy tokenizer (``--legacy-tokenizer``:
  its default tokenizer system fetches ``gpt2`` from the Hugging Face Hub for this type), with and without
  ``--append-eod``;
- HuggingFaceTokenizer (a directory whose tokenizer puts a BOS before every text) through Megatron-LM's
  default system (no special tokens) and its legacy one (``tokenizer(text).input_ids``, BOS included), which
  build_dataset.py gives with ``--tokenizer-hf-include-special-tokens``.

On core_v0.19, whose ``preprocess_data.py`` has no ``--legacy-tokenizer`` and encodes with the special tokens, the
HuggingFaceTokenizer case is compared with ``--tokenizer-hf-include-special-tokens`` and the legacy cases are skipped
(GPT2BPETokenizer there is Hugging Face's ``gpt2`` from the Hub).

The ``.bin`` and ``.idx`` files must be identical; pretrain_gpt.py's checks then accept preprocess_data.py's
dataset (it has no record: its token ids are scanned) and megatron-core's GPTDataset reads it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tenplex_megatron.training.data import build_train_dataset, check_data_path
from tenplex_megatron.training.dataset_files import meta_path
from tenplex_megatron.training.tokenizer import TokenizerSpec, build_tokenizer
from tests.harness import ROOT
from tests.megatron_lm.test_megatron_lm import NVRX_ENV, RELEASE
from tests.tokenizer_files import EOT, make_tokenizer_files, training_text

pytestmark = pytest.mark.megatron_lm
MLM = os.environ.get("MEGATRON_LM_PATH")

CASES = {  # name: (tokenizer, preprocess_data.py flags, build_dataset.py flags)
    "gpt2-eod": ("gpt2", ["--legacy-tokenizer", "--append-eod"], []),
    "gpt2-no-eod": ("gpt2", ["--legacy-tokenizer"], ["--no-append-eod"]),
    "hf-eod": ("hf", ["--append-eod"], []),
    "hf-legacy-special": ("hf", ["--legacy-tokenizer", "--append-eod"], ["--tokenizer-hf-include-special-tokens"]),
}


def _load_build_dataset():
    spec = importlib.util.spec_from_file_location("build_dataset", os.path.join(ROOT, "scripts", "build_dataset.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("preprocess")
    t = make_tokenizer_files(str(root / "tok"), 300, post_bos=True)
    src = root / "docs.jsonl"
    docs = [*training_text(300, seed=21), "", ["first sentence.", "", f" second one {EOT} here"], "✓ 数据\n newline"]
    with open(src, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i}) + "\n")
    return {"root": root, "src": str(src), "tok": t,
            "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", t.vocab_file, "--merge-file", t.merge_file],
            "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", t.hf_dir]}


@pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set")
@pytest.mark.parametrize("case", list(CASES))
def test_same_bytes_as_preprocess_data(inputs: dict, case: str) -> None:
    kind, theirs, ours = CASES[case]
    if RELEASE[:2] >= (0, 19):
        if "--legacy-tokenizer" in theirs:
            pytest.skip("core_v0.19's tools/preprocess_data.py has no --legacy-tokenizer (its legacy tokenizer system is "
                        "gone), and its own system loads GPT2BPETokenizer as Hugging Face's `gpt2` from the Hub")
        # core_v0.19's own system encodes a HuggingFaceTokenizer's text with its special tokens (the BOS here), as
        # the legacy system did up to core_v0.18
        ours = [*ours, "--tokenizer-hf-include-special-tokens"]
    root = inputs["root"]
    # the runner's site first (typing.override on 3.11, nvidia-resiliency-ext hidden for core_v0.19: NVRX_ENV)
    site = os.path.join(ROOT, "tests", "megatron_lm", "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, MLM, os.environ.get("PYTHONPATH", "")) if p),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **NVRX_ENV)
    p = subprocess.run([sys.executable, os.path.join(MLM, "tools", "preprocess_data.py"), "--input", inputs["src"],
                        "--output-prefix", str(root / f"mlm_{case}"), "--workers", "2", *inputs[kind], *theirs],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    mlm = str(root / f"mlm_{case}_text_document")
    mine = str(root / f"mine_{case}")
    assert _load_build_dataset().main(["--input", inputs["src"], "--out", mine, "--workers", "2", *inputs[kind],
                                       *ours]) == 0
    for ext in (".bin", ".idx"):
        with open(mlm + ext, "rb") as a, open(mine + ext, "rb") as b:
            assert a.read() == b.read(), f"{ext} differs from preprocess_data.py's"
    assert not os.path.exists(meta_path(mlm))
    t = inputs["tok"]
    spec = (TokenizerSpec("GPT2BPETokenizer", vocab_file=t.vocab_file, merge_file=t.merge_file) if kind == "gpt2" else
            TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=t.hf_dir,
                          include_special_tokens="--tokenizer-hf-include-special-tokens" in ours))
    tok = build_tokenizer(spec)
    check_data_path([mlm], tok)
    assert len(build_train_dataset([mlm], "100,0,0", 16, 1234, 8, tok)) >= 8
