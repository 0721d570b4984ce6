"""--data-path without torch.distributed: the byte-level tokenizer, scripts/build_dataset.py, megatron-core's
GPTDataset read in a DP-independent order, and errors that name a bad dataset prefix."""

from __future__ import annotations

import importlib.util
import os
import shutil

import numpy as np
import pytest
import torch

from tenplex_megatron.training.data import (
    BATCH_KEYS,
    ByteTokenizer,
    build_train_dataset,
    check_data_path,
    microbatches_from_dataset,
    parse_blend,
)
from tests.harness import ROOT

SEQ, GBS = 32, 8


def _load_build_dataset():
    spec = importlib.util.spec_from_file_location("build_dataset", os.path.join(ROOT, "scripts", "build_dataset.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bd = _load_build_dataset()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    prefix, _ = bd.build(bd.generated_documents(120, seed=7), str(tmp_path_factory.mktemp("data") / "corpus"))
    return prefix


@pytest.fixture(scope="module")
def dataset(corpus: str):
    return build_train_dataset([corpus], "100,0,0", SEQ, 1234, 6 * GBS, ByteTokenizer())


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    text = "Grace has 3 GPUs, naïve café ✓ 数据\n"
    ids = tok.tokenize(text)
    assert ids.dtype == np.int64 and len(ids) == len(text.encode("utf-8")) and ids.max() < 256
    assert tok.detokenize(np.append(ids, tok.eod)) == text
    assert tok.detokenize(torch.as_tensor(ids)) == text
    assert tok.unique_identifiers["vocab_size"] == 257


def test_generated_corpus_is_deterministic_and_indexed(corpus: str, tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = bd.generated_documents(120, seed=7)
    assert docs == bd.generated_documents(120, seed=7) and docs != bd.generated_documents(120, seed=8)
    again, tokens = bd.build(docs, str(tmp_path / "again"))
    for ext in (".bin", ".idx"):
        with open(corpus + ext, "rb") as a, open(again + ext, "rb") as b:
            assert a.read() == b.read()
    ds = IndexedDataset(corpus)
    assert len(ds) == len(docs) and sum(len(ds[i]) for i in range(len(ds))) == tokens
    tok = ByteTokenizer()
    for i in (0, 57, len(docs) - 1):
        assert ds[i][-1] == tok.eod and tok.detokenize(ds[i]) == docs[i]


def test_text_documents_per_file_or_paragraph(tmp_path) -> None:
    d = tmp_path / "texts"
    d.mkdir()
    (d / "b.txt").write_text("first paragraph\nstill first\n\n  \nsecond ✓\n")
    (d / "a.txt").write_text("alpha")
    (d / "empty.txt").write_text("\n\n")
    (d / "notes.md").write_text("not a .txt file")
    assert bd.text_documents([str(d)]) == ["alpha", "first paragraph\nstill first\n\n  \nsecond ✓"]
    assert bd.text_documents([str(d)], paragraphs=True) == ["alpha", "first paragraph\nstill first", "second ✓"]
    assert bd.main(["--input", str(d), "--paragraphs", "--generate", "2", "--out", str(tmp_path / "mixed")]) == 0
    check_data_path([str(tmp_path / "mixed")])
    with pytest.raises(SystemExit):
        bd.main(["--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")])


def test_global_batches_do_not_depend_on_dp(dataset) -> None:
    """Whatever DP and micro-batch size, the DP ranks' micro-batches of global batch b are dataset[b*G:(b+1)*G]."""
    for b in range(6):
        ref = [dataset[i] for i in range(b * GBS, (b + 1) * GBS)]
        want = {k: torch.stack([torch.as_tensor(x[k]) for x in ref]) for k in BATCH_KEYS}
        assert torch.equal(want["tokens"][:, 1:], want["labels"][:, :-1])
        for dp in (1, 2, 4):
            for mbs in (1, 2):
                got = [mb for r in range(dp) for mb in microbatches_from_dataset(dataset, b * GBS, GBS, mbs, dp, r)]
                assert len(got) == GBS // mbs
                for k in BATCH_KEYS:
                    assert got[0][k].shape == (mbs, SEQ)
                    assert torch.equal(torch.cat([mb[k] for mb in got]), want[k]), (b, dp, mbs, k)
    assert want["tokens"].dtype == torch.int64 and want["loss_mask"].dtype == torch.float32


def test_dataset_order_follows_the_seed_only(corpus: str, dataset) -> None:
    """GPTDataset's shuffle is seeded by --seed: the same seed gives the same samples, another seed others."""
    same = build_train_dataset([corpus], "100,0,0", SEQ, 1234, 6 * GBS)
    other = build_train_dataset([corpus], "100,0,0", SEQ, 99, 6 * GBS)
    first = torch.stack([dataset[i]["tokens"] for i in range(GBS)])
    assert torch.equal(first, torch.stack([same[i]["tokens"] for i in range(GBS)]))
    assert not torch.equal(first, torch.stack([other[i]["tokens"] for i in range(GBS)]))


def test_data_path_blend_syntax_matches_megatron_core(corpus: str) -> None:
    from megatron.core.datasets.utils import get_blend_from_list

    for blend in (["a"], ["a", "b"], ["a", "b", "c"], ["30", "a", "70", "b"], ["0.5", " a "]):
        assert parse_blend(blend) == tuple(get_blend_from_list(blend))
    check_data_path(["1", corpus, "2", corpus])
    with pytest.raises(ValueError, match="WEIGHT PREFIX"):
        parse_blend(["30", "a", "b", "c"])


def test_bad_data_path_is_named(corpus: str, tmp_path) -> None:
    missing = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match=f"--data-path {missing}: not a Megatron indexed dataset"):
        check_data_path([missing])
    with pytest.raises(ValueError, match=f"--data-path {missing}: not a Megatron indexed dataset"):
        build_train_dataset([corpus, missing], "100,0,0", SEQ, 1, 8)
    with pytest.raises(ValueError, match=f"--data-path {missing}"):
        check_data_path(["0.5", corpus, "0.5", missing])
    only_bin = str(tmp_path / "only_bin")
    shutil.copy(corpus + ".bin", only_bin + ".bin")
    with pytest.raises(ValueError, match=rf"{only_bin}\.idx missing"):
        check_data_path([only_bin])
    fake = str(tmp_path / "fake")
    (tmp_path / "fake.bin").write_bytes(b"x")
    (tmp_path / "fake.idx").write_bytes(b"not an index")
    with pytest.raises(ValueError, match=rf"--data-path {fake}: {fake}\.idx is not a Megatron index file"):
        check_data_path([fake])
    cut = str(tmp_path / "cut")
    shutil.copy(corpus + ".idx", cut + ".idx")
    with open(corpus + ".bin", "rb") as f:
        (tmp_path / "cut.bin").write_bytes(f.read()[:-10])
    with pytest.raises(ValueError, match=rf"--data-path {cut}: {cut}\.bin has"):
        check_data_path([cut])


def test_pretrain_flags_for_data_path(corpus: str, capsys: pytest.CaptureFixture) -> None:
    from tenplex_megatron.training.pretrain import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2"]
    assert parse_args([*base, "--data-path", corpus]).vocab_size == 257
    assert parse_args([*base, "--data-path", corpus, "--tokenizer-type", "ByteLevel", "--vocab-size", "257"]).vocab_size == 257
    assert parse_args([*base, "--mock-data", "--tokenizer-type", "ByteLevel"]).vocab_size == 257
    for bad, msg in (
        (["--data-path", corpus, "--vocab-size", "300"], "--vocab-size 300 does not match"),
        (["--data-path", corpus, "--tokenizer-type", "GPT2BPETokenizer"],
         "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
        (["--data-path"], "--data-path needs at least one dataset prefix"),
        (["--data-path", corpus + "_nope"], f"--data-path {corpus}_nope: not a Megatron indexed dataset"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
        assert msg in capsys.readouterr().err
