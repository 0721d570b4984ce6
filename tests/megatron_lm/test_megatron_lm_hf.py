"""Opt-in: Megatron-LM's own pretrain_gpt.py with our patch starts from a transformers GPT-2 checkpoint.

Needs ``MEGATRON_LM_PATH`` (see ``test_megatron_lm.py``). One launch of 2
processes at TP=2 with ``--tenplex --tenplex-init-from-hf DIR --load EMPTYDIR``
and ``--mock-data``; the runner records the samples Megatron-LM's dataset hands
out (``TENPLEX_TEST_SAMPLES``), and transformers' own model, loaded from DIR in
this process (which never installs the CPU shim), computes the loss on that
very global batch: Megatron-LM's first iteration must print the same (fp32,
dropout 0, 1e-5 relative).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.megatron_lm.test_megatron_lm import MLM, _losses, _run, patched_script

pytestmark = pytest.mark.megatron_lm
transformers = pytest.importorskip("transformers")

VOCAB = 95  # NullTokenizer adds EOD: 96 rows, a multiple of 16 x TP2, so Megatron adds no padding rows
GBS = 8  # test_megatron_lm.FLAGS' --global-batch-size
SEQ = 64  # and --seq-length, --max-position-embeddings


def _gpt2_dir(path: str) -> None:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB + 1,
                                  activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random layer norms too (transformers initialises them to 1 and 0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(path)


def _transformers_loss(path: str, samples: list[dict]) -> float:
    """Megatron-LM's reported ``lm loss``: summed over the global batch's unmasked tokens, divided by their count."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tokens = torch.tensor([s["tokens"] for s in samples])
    labels = torch.tensor([s["labels"] for s in samples])
    mask = torch.tensor([s["loss_mask"] for s in samples], dtype=torch.float64)
    with torch.no_grad():
        logits = model(tokens).logits
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB + 1), labels.reshape(-1), reduction="none")
    return float((losses.double() * mask.reshape(-1)).sum() / mask.sum())


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.x checkout")
def test_megatron_lm_init_from_hf_first_loss_equals_transformers(tmp_path, monkeypatch) -> None:
    script = patched_script(tmp_path)
    hf, empty, samples_file = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "samples.jsonl"
    _gpt2_dir(str(hf))
    empty.mkdir()
    monkeypatch.setenv("TENPLEX_TEST_SAMPLES", str(samples_file))
    log = _run(script, 2, VOCAB, ["--train-iters", "1", "--lr-warmup-iters", "0", "--num-workers", "0", "--tenplex-init-from-hf", str(hf),
                                  "--load", str(empty)])
    assert f"> tenplex: initialised from Hugging Face checkpoint {hf} at layout tp=2,pp=1,dp=1" in log, log[-3000:]
    # no padding rows: transformers' softmax and Megatron's cover the same rows
    assert "with 0 dummy tokens (new size: 96)" in log, log[-3000:]
    losses = _losses(log)
    assert sorted(losses) == [1], log[-3000:]

    by_idx = {}
    with open(samples_file) as f:
        for line in f:
            s = json.loads(line)
            by_idx.setdefault(s["idx"], s)
    # the hook's sampler: global batch 0 is dataset samples 0..GBS-1
    assert set(range(GBS)) <= set(by_idx), sorted(by_idx)
    batch = [by_idx[i] for i in range(GBS)]
    assert all(len(s["tokens"]) == SEQ for s in batch)
    ref = _transformers_loss(str(hf), batch)
    print(f"Megatron-LM first loss {losses[1]:.7g}, transformers {ref:.7g}")
    assert losses[1] == pytest.approx(ref, rel=1e-5), (losses[1], ref)
    assert not os.listdir(empty)  # nothing saved: no --save


# Mixtral-style under Megatron-LM's own flags: rope (theta 1e6), RMSNorm, SwiGLU, no biases, 4 heads in 2 groups,
# 4 experts of width 48, top-2 with Megatron's default post-top-k softmax; EP2 x DP2 (Megatron-LM refuses MoE with TP
# but without sequence parallelism, which the CPU's torch norms do not carry)
MIXTRAL = ["--position-embedding-type", "rope", "--rotary-base", "1000000", "--no-rope-fusion", "--normalization",
           "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--group-query-attention",
           "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "48",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
           "--moe-token-dispatcher-type", "allgather", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
           "--expert-model-parallel-size", "2"]


def _mixtral_dir(path: str) -> None:
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=VOCAB + 1, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(path)


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.x checkout")
def test_megatron_lm_init_from_hf_mixtral_at_ep2_first_loss_equals_transformers(tmp_path, monkeypatch) -> None:
    script = patched_script(tmp_path)
    hf, empty, samples_file = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "samples.jsonl"
    _mixtral_dir(str(hf))
    empty.mkdir()
    monkeypatch.setenv("TENPLEX_TEST_SAMPLES", str(samples_file))
    log = _run(script, 1, VOCAB, ["--train-iters", "1", "--lr-warmup-iters", "0", "--num-workers", "0", *MIXTRAL,
                                  "--tenplex-init-from-hf", str(hf), "--load", str(empty)])
    assert f"> tenplex: initialised from Hugging Face checkpoint {hf}" in log, log[-3000:]
    assert "with 0 dummy tokens (new size: 96)" in log, log[-3000:]
    losses = _losses(log)
    assert sorted(losses) == [1], log[-3000:]
    by_idx = {}
    for name in (samples_file, f"{samples_file}.rank1"):  # the two DP ranks' halves of the global batch
        with open(name) as f:
            for line in f:
                s = json.loads(line)
                by_idx.setdefault(s["idx"], s)
    assert set(range(GBS)) <= set(by_idx), sorted(by_idx)
    batch = [by_idx[i] for i in range(GBS)]
    ref = _transformers_loss(str(hf), batch)
    print(f"Megatron-LM (EP2 x DP2) first loss {losses[1]:.7g}, transformers Mixtral {ref:.7g}")
    assert losses[1] == pytest.approx(ref, rel=1e-5), (losses[1], ref)
