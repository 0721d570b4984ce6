"""Hugging Face out and in, at any layout, with transformers' own models as the oracle (one torchrun launch).

The launch (``hf_run.py``, 4 ranks) saves random megatron-core models, GPT-2
style and Llama style (rope, RMSNorm, SwiGLU, no biases, 8 query heads in 2
groups), at TP2 x PP2 and at TP1 (x DP4 or x PP2, distributed optimizer or not,
tied or untied output layer), and a Mixtral-style mixture of experts at TP2 x
EP2, with their logits on fixed tokens, starts jobs at TP2 x PP2 (the Mixtral
at EP4, and at TP2 x EP2 with expert TP 1) from transformers checkpoints
(``--tenplex-init-from-hf``), and records refused configs. This
process then exports with ``python -m tenplex_megatron export-hf`` (no
torch.distributed) and compares, with transformers' own model classes:

- export: transformers' logits equal megatron-core's (fp32, 1e-5 relative);
- import: the first iteration's loss equals transformers' loss on the same batch;
- round trip: transformers -> import at TP2 x PP2 -> tenplex checkpoint ->
  export gives every tensor back bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from tenplex_megatron.training.synthetic_data import batch_from_indices
from tests.harness import ROOT, TINY_GPT, layout_flags, metrics, torchrun

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist
HF_RUN = os.path.join(ROOT, "tests", "multiproc", "hf_run.py")
RTOL = 1e-5
VOCAB = 100
GBS = 8


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (layer norms included: transformers initialises them to 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _gpt2_dir(path: str) -> str:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB,
                                  activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = _perturbed(transformers.GPT2LMHeadModel(cfg), 1)
    model.save_pretrained(path, max_shard_size="100KB")  # several shards and an index
    return path


def _llama_dir(path: str) -> str:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=32,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = _perturbed(transformers.LlamaForCausalLM(cfg), 2)
    model.save_pretrained(path, max_shard_size="100KB")
    return path


def _mixtral_dir(path: str) -> str:
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                     intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                                     max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = _perturbed(transformers.MixtralForCausalLM(cfg), 3)
    model.save_pretrained(path, max_shard_size="100KB")  # block_sparse_moe.experts.N.w1/w2/w3 on disk
    return path


def _flags(*extra: str) -> list[str]:
    return [*TINY_GPT, "--vocab-size", str(VOCAB), *extra]


# Llama-style: rope, RMSNorm, SwiGLU, no biases, 8 query heads in 2 key/value groups (one group per rank at TP2)
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
         "--disable-bias-linear", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
         "--ffn-hidden-size", "96", "--untie-embeddings-and-output-weights"]
# Mixtral-style: the same attention, every MLP 4 routed experts of width 48, top-2 (megatron-core's default
# softmax after the top-k: Mixtral's softmax over all experts, top-k, renormalised)
MIXTRAL = [*LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--rotary-base", "1000000"]
ARCH_FLAGS = {"gpt2": [], "llama": LLAMA, "mixtral": MIXTRAL}
EXPORTS = [("gpt2", "tp2pp2"), ("gpt2", "tp1"), ("llama", "tp2pp2"), ("llama", "tp1"), ("mixtral", "tp2ep2")]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = str(tmp_path_factory.mktemp("hf"))
    names = ["hf_gpt2", "hf_llama", "hf_mixtral", "refused", "refused_experts"]
    for arch, layout in EXPORTS:
        names += [f"ck_{arch}_{layout}", f"lg_{arch}_{layout}"]
    for arch in ARCH_FLAGS:
        names += [f"ck_{arch}_rt", f"loss_{arch}.jsonl"]
    p = {k: os.path.join(d, k) for k in names}
    _gpt2_dir(p["hf_gpt2"])
    _llama_dir(p["hf_llama"])
    _mixtral_dir(p["hf_mixtral"])
    tasks = [
        {"kind": "logits", "flags": _flags(*layout_flags(2, 2), "--train-iters", "4"), "save": p["ck_gpt2_tp2pp2"],
         "out": p["lg_gpt2_tp2pp2"]},
        {"kind": "logits", "flags": _flags(*layout_flags(1, 1), "--train-iters", "4", "--use-distributed-optimizer",
                                           "--untie-embeddings-and-output-weights"),
         "save": p["ck_gpt2_tp1"], "out": p["lg_gpt2_tp1"]},
        {"kind": "logits", "flags": _flags(*LLAMA, *layout_flags(2, 2), "--train-iters", "4",
                                           "--use-distributed-optimizer"),
         "save": p["ck_llama_tp2pp2"], "out": p["lg_llama_tp2pp2"]},
        {"kind": "logits", "flags": _flags(*LLAMA, *layout_flags(1, 2), "--train-iters", "4"),
         "save": p["ck_llama_tp1"], "out": p["lg_llama_tp1"]},
        # TP2 x EP2: each rank two whole experts, each cut in two by expert TP
        {"kind": "logits", "flags": _flags(*MIXTRAL, *layout_flags(2, 1), "--expert-model-parallel-size", "2",
                                           "--train-iters", "4", "--use-distributed-optimizer"),
         "save": p["ck_mixtral_tp2ep2"], "out": p["lg_mixtral_tp2ep2"]},
    ]
    # the imports at another EP than the export: EP4 (one expert a rank) and TP2 x EP2 with expert TP 1
    import_layout = {"gpt2": layout_flags(2, 2), "llama": layout_flags(2, 2),
                     "mixtral": [*layout_flags(1, 1), "--expert-model-parallel-size", "4"]}
    rt_layout = {**import_layout, "mixtral": [*layout_flags(2, 1), "--expert-model-parallel-size", "2",
                                              "--expert-tensor-parallel-size", "1"]}
    for arch, extra in ARCH_FLAGS.items():
        tasks += [
            # no vocabulary padding (megatron's softmax covers padding rows, transformers' has none): losses compare
            {"kind": "pretrain", "flags": _flags(*extra, *import_layout[arch], "--train-iters", "4", "--exit-interval",
                                                 "1", "--make-vocab-size-divisible-by", "1", "--tenplex-init-from-hf",
                                                 p[f"hf_{arch}"], "--tenplex-metrics", p[f"loss_{arch}.jsonl"])},
            # padded to 128 at TP2: the padding rows start at zero and are dropped again at export
            {"kind": "pretrain", "flags": _flags(*extra, *rt_layout[arch], "--train-iters", "4", "--exit-interval",
                                                 "0", "--use-distributed-optimizer", "--tenplex-init-from-hf",
                                                 p[f"hf_{arch}"], "--save", p[f"ck_{arch}_rt"])},
        ]
    tasks += [
        {"kind": "refused", "flags": [*TINY_GPT, "--vocab-size", str(VOCAB), "--hidden-size", "32",
                                      *layout_flags(2, 2), "--train-iters", "4", "--tenplex-init-from-hf",
                                      p["hf_gpt2"]], "out": p["refused"]},
        {"kind": "refused", "flags": _flags(*MIXTRAL, "--num-experts", "8", *layout_flags(1, 1),
                                            "--expert-model-parallel-size", "2", "--train-iters", "4",
                                            "--tenplex-init-from-hf", p["hf_mixtral"]), "out": p["refused_experts"]},
    ]
    tasks_file = os.path.join(d, "tasks.json")
    with open(tasks_file, "w") as f:
        json.dump(tasks, f)
    run = torchrun(4, [tasks_file], timeout=600, script=HF_RUN)
    assert run.returncode == 0, run.log[-6000:]
    return p


def _export(ckpt: str, out: str, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tenplex_megatron", "export-hf", ckpt, out, *flags],
                          env=env, capture_output=True, text=True, timeout=300)


def _hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize(("arch", "layout"), EXPORTS)
def test_export_logits_equal_megatron(hf_runs: dict[str, str], tmp_path, arch: str, layout: str) -> None:
    out = str(tmp_path / "hf")
    r = _export(hf_runs[f"ck_{arch}_{layout}"], out, "--max-shard-size", "50KB")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1  # sharded as asked
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.model_type == arch and cfg.tie_word_embeddings == (arch == "gpt2" and layout == "tp2pp2")
    if arch == "llama":
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (8, 2, 96)
    if arch == "mixtral":
        assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (4, 2, 48)
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in json.load(f)["weight_map"]
    saved = load_file(hf_runs[f"lg_{arch}_{layout}"])
    megatron = saved["logits"][..., :VOCAB]  # padded vocabulary columns dropped
    assert saved["logits"].shape[-1] > VOCAB  # the model had padding rows
    hf = _hf_logits(out, saved["tokens"])
    assert hf.shape == megatron.shape
    err = (hf - megatron).abs().max() / megatron.abs().max()
    assert err <= RTOL, f"{layout}: relative logits error {err}"


def test_export_refuses_non_empty_dir(hf_runs: dict[str, str], tmp_path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    r = _export(hf_runs["ck_gpt2_tp1"], str(out))
    assert r.returncode == 2 and "not empty" in r.stderr and "--force" in r.stderr
    assert sorted(os.listdir(out)) == ["notes.txt"]
    r = _export(hf_runs["ck_gpt2_tp1"], str(out), "--force", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    with safe_open(str(out / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("arch", list(ARCH_FLAGS))
def test_import_first_loss_equals_transformers(hf_runs: dict[str, str], arch: str) -> None:
    loss = metrics(hf_runs[f"loss_{arch}.jsonl"])[0]["loss"]
    batch = batch_from_indices(list(range(GBS)), 32, VOCAB, 1234)
    logits = _hf_logits(hf_runs[f"hf_{arch}"], batch["tokens"])
    ref = float(F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)))
    assert abs(loss - ref) <= RTOL * abs(ref), (loss, ref)


@pytest.mark.parametrize("arch", list(ARCH_FLAGS))
def test_round_trip_bit_identical(hf_runs: dict[str, str], tmp_path, arch: str) -> None:
    out = str(tmp_path / "rt")
    r = _export(hf_runs[f"ck_{arch}_rt"], out)
    assert r.returncode == 0, r.stderr

    def tensors(path: str) -> dict[str, torch.Tensor]:
        got = {}
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                got.update(load_file(os.path.join(path, name)))
        return got

    original, back = tensors(hf_runs[f"hf_{arch}"]), tensors(out)
    assert sorted(original) == sorted(back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_import_refuses_config_mismatch(hf_runs: dict[str, str]) -> None:
    for rank in range(4):
        with open(f"{hf_runs['refused']}.rank{rank}") as f:
            msg = json.load(f)["message"]
        assert msg is not None and "hidden_size" in msg and "64" in msg and "32" in msg and "--hidden-size" in msg, msg


def test_import_refuses_another_expert_count(hf_runs: dict[str, str]) -> None:
    for rank in range(4):
        with open(f"{hf_runs['refused_experts']}.rank{rank}") as f:
            msg = json.load(f)["message"]
        assert msg is not None and "num_local_experts is 4 in the Hugging Face config but 8 from the flags " \
            "(--num-experts)" in msg and "config.json" in msg, msg
