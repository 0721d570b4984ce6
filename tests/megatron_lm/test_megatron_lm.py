"""Opt-in: Megatron-LM's own pretrain_gpt.py with our patch, restarted at another layout with --tenplex.

Needs ``MEGATRON_LM_PATH`` (a core_v0.15.x-0.19.x checkout, never committed here). Runs
``pytest -m megatron_lm tests/megatron_lm``. The checkout is not modified: the
patch is applied to a copy of its top-level scripts (Megatron-LM itself builds
its dataset helpers into ``megatron/core/datasets`` on first use, which needs
``pybind11``; importing it needs ``triton``). On a CPU-only machine the runner
(``run_megatron_lm.py``) installs a CPU shim first and the job runs over gloo.

Launches of 2 processes: an uninterrupted TP=2 run of 8 iterations per
vocabulary (shared by the tests); a TP=2 run that saves a tenplex checkpoint at
iteration 4 and exits; a TP=1 x DP=2 run that loads it and trains iterations 5-8
(with vocab 96 the hook's ``--tenplex-layout FILE.json`` chooses that layout and
micro-batch 1, over the command line's 2, before Megatron-LM checks its flags).
And Megatron-LM's own checkpoint: a TP=2 run *without* ``--tenplex`` saving at
iteration 4 in its own format (``torch_dist`` dp_reshardable, or ``torch``),
adopted by a TP=1 x DP=2 run with ``--tenplex``; and a mixture of experts at EP=2
saving its own ``torch_dist`` (the chained dense + expert optimizer, dp_reshardable)
without ``--tenplex``, adopted at EP=1 x DP=2. The restarted losses must equal the
uninterrupted run's, step by step. What GPU runs turn on (sequence parallelism, an interleaved pipeline, fp16)
and a mixture of experts at a new EP, expert TP, TP or PP (one case on 4 processes) go through the same oracle.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable

import psutil
import pytest

from tenplex_megatron.plan.experts import expert_summary
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.distcp_index import read_dcp_metadata
from tests.harness import ROOT, flip

pytestmark = pytest.mark.megatron_lm
MLM = os.environ.get("MEGATRON_LM_PATH")



def patch_for(checkout: str) -> str:
    """patches/megatron-lm-core_vX.Y.x.patch for the release line of the checkout's megatron/core/package_info.py."""
    from tenplex_megatron import mcore_versions

    text = mcore_versions._from_package_info(os.path.join(checkout, "megatron", "core", "package_info.py"))
    assert text, f"{checkout}: no megatron/core/package_info.py (not a Megatron-LM checkout?)"
    major, minor, _ = mcore_versions.parse(text)
    path = os.path.join(ROOT, "patches", f"megatron-lm-core_v{major}.{minor}.x.patch")
    assert os.path.isfile(path), f"{checkout} is Megatron-LM core_v{text}: no patch for that release line ({path})"
    return path


def _release(checkout: str) -> tuple[int, int, int]:
    from tenplex_megatron import mcore_versions

    text = mcore_versions._from_package_info(os.path.join(checkout, "megatron", "core", "package_info.py"))
    return mcore_versions.parse(text) if text else (0, 0, 0)


RELEASE = _release(MLM) if MLM else (0, 0, 0)
# Up to core_v0.15, --mock-data's MockGPTLowLevelDataset emits token ids up to its 4096-token maximum document
# length whatever the vocabulary (0.16 takes them modulo the vocabulary): there every vocabulary is 4000 larger, a
# multiple of 32, so the padding at TP 1 and 2 (multiples of 16 x TP) works out as below with 4000 added.
VOCAB_BASE = 4000 if MLM and RELEASE[:2] < (0, 16) else 0


def _vocab_flag(vocab: int) -> str:
    """``--vocab-size`` for a test's ``vocab`` (as core_v0.16 counts it: NullTokenizer adds an EOD token, vocab + 1
    rows). From core_v0.18 NullTokenizer's EOD is the last id of ``--vocab-size`` itself: there it is one more."""
    return str(VOCAB_BASE + vocab + (1 if RELEASE[:2] >= (0, 18) else 0))


RUNNER = os.path.join(ROOT, "tests", "megatron_lm", "run_megatron_lm.py")


def _nvrx_env() -> dict[str, str]:
    """From core_v0.17.1 ``megatron.core``'s import asserts nvidia-resiliency-ext >= 0.6 when one is installed; the
    ``[inprocess]`` extra pins 0.4.1 (Python 3.11). There the runner's site hides it (``TENPLEX_TEST_HIDE_NVRX``,
    ``site/sitecustomize.py``), as an environment without that extra: only the in-process tests use it."""
    from importlib import metadata

    from packaging.version import Version

    from tenplex_megatron import mcore_versions

    try:
        installed = Version(metadata.version("nvidia-resiliency-ext"))
    except metadata.PackageNotFoundError:
        return {}
    return {"TENPLEX_TEST_HIDE_NVRX": "1"} if RELEASE >= mcore_versions.NVRX_ASSERTED_FROM and installed < Version("0.6") else {}


NVRX_ENV = _nvrx_env() if MLM else {}

# --eval-interval: Megatron-LM divides by it even with --eval-iters 0.
# --no-persist-layer-norm: the local transformer's torch LayerNorm refuses it (no apex).
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "16",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local", "--no-persist-layer-norm",
    "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--deterministic-mode", "--no-gradient-accumulation-fusion",
]
#: in a case's flags: that launch leaves out FLAGS' --use-distributed-optimizer (Megatron-LM has no flag to turn it
#: off), so it trains with megatron-core's plain optimizer (Float16OptimizerWithFloat16Params / FP32Optimizer)
PLAIN_OPTIMIZER = "<plain optimizer>"
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?lm loss: ([0-9.E+-]+)")


def _log_lines(log: str) -> list[tuple[int, int, float]]:
    return [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in LINE.finditer(log)]


def _losses(log: str) -> dict[int, float]:
    """Each iteration's own loss.

    From core_v0.16, Megatron-LM's training_log does not reset its running sums
    after the first iteration of a launch (``is_first_iteration``), so the second
    line of every launch prints the mean of the first two iterations: undone here
    (core_v0.15 logs every iteration's own loss).
    """
    lines = _log_lines(log)
    out = {it: loss for it, _, loss in lines}
    if len(lines) >= 2 and RELEASE[:2] >= (0, 16):
        (_, _, l1), (second, _, mean) = lines[0], lines[1]
        out[second] = 2 * mean - l1
    return out


def patched_script(tmp_path: pathlib.Path) -> str:
    """A copy of the checkout's top-level scripts with our patch applied; returns its ``pretrain_gpt.py``."""
    work = tmp_path / "mlm"
    work.mkdir()
    for name in os.listdir(MLM):
        if name.endswith(".py"):
            shutil.copy(os.path.join(MLM, name), work / name)
    subprocess.run(["git", "apply", patch_for(MLM)], cwd=work, check=True)
    return str(work / "pretrain_gpt.py")


def _env() -> tuple[dict[str, str], bool]:
    """The environment of a Megatron-LM launch, and whether it runs on the CPU."""
    import torch

    cpu = not torch.cuda.is_available()
    # Megatron-LM builds its dataset helpers with `python3 -m pybind11` and `python3-config` from PATH:
    # make both this interpreter's.
    path = os.pathsep.join([os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or "",
                            os.environ.get("PATH", "")])
    extra_path = os.environ.get("PYTHONPATH")  # kept after ours (e.g. where triton and pybind11 are installed)
    env = dict(os.environ, PYTHONPATH=f"{MLM}:{ROOT}" + (f":{extra_path}" if extra_path else ""), PATH=path,
               OMP_NUM_THREADS="1", **NVRX_ENV,
               CUBLAS_WORKSPACE_CONFIG=":4096:8",
               NCCL_ALGO="Ring",  # --deterministic-mode requires it
               CUDA_DEVICE_MAX_CONNECTIONS="1")  # TP > 1 requires it before Blackwell
    if cpu:
        env["TORCH_COMPILE_DISABLE"] = "1"  # jit_fuser is torch.compile: its C++ warm-up builds cost ~40 s a launch here
    return env, cpu


def _run(script: str, tp: int | None, vocab: int, extra: list[str], tenplex: bool = True, nproc: int = 2,
         ok: bool = True, base: list[str] | None = None) -> str:
    """One launch of ``nproc`` processes: ``base`` (default FLAGS), ``--tenplex``, the vocabulary, TP, ``extra``."""
    env, cpu = _env()
    backend = ["--distributed-backend", "gloo"] if cpu else []
    plain = PLAIN_OPTIMIZER in extra
    flags = [f for f in (FLAGS if base is None else base) if not (plain and f == "--use-distributed-optimizer")]
    extra = [f for f in extra if f != PLAIN_OPTIMIZER]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), RUNNER, script,
           *flags, *(["--tenplex"] if tenplex else []), *backend, "--vocab-size", _vocab_flag(vocab),
           *(["--tensor-model-parallel-size", str(tp)] if tp is not None else []), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert (p.returncode == 0) == ok, (p.stdout + p.stderr)[-5000:]
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkout's top-level scripts, copied and patched (the checkout itself is not modified)."""
    return patched_script(tmp_path_factory.mktemp("mlm-module"))


_REFERENCE: dict[int, dict[int, float]] = {}


def _reference(script: str, vocab: int) -> dict[int, float]:
    """The uninterrupted TP=2 run's losses (one launch per vocabulary, shared by the tests of this module)."""
    if vocab not in _REFERENCE:
        log = _run(script, 2, vocab, [])
        _REFERENCE[vocab] = _losses(log)
        assert sorted(_REFERENCE[vocab]) == list(range(1, 9)), log[-3000:]
    return _REFERENCE[vocab]


# NullTokenizer adds an EOD token to --vocab-size (up to core_v0.17; _vocab_flag). 95 -> 96 rows: no padding at
# TP 1 or 2. 96 -> 97 rows: padded to 128 at TP=2 and, by Megatron's rule, to 112 at TP=1; Megatron's softmax covers
# the padding rows, so the hook keeps the checkpoint's 128 (--tenplex-vocab-padding keep) for the restart to
# continue exactly.
@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("vocab", [95, 96])
def test_megatron_lm_restart_at_another_layout_continues_losses(tmp_path, script: str, vocab: int) -> None:
    ref = _reference(script, vocab)

    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, vocab, ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"])
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    meta = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    assert meta["format"] == "tenplex-megatron" and meta["iteration"] == 4
    assert meta["layout"] == {"tp": 2, "pp": 1, "dp": 1} and meta["consumed_samples"] == 32
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not list(ckpt.glob("iter_0000004/*.distcp")), "Megatron's own torch_dist save ran"
    first = _losses(log)
    for it in range(1, 5):
        assert first[it] == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, first[it], ref[it])

    # TP2 -> TP1xDP2: by the flag (vocab 95), or by the hook's --tenplex-layout with a user's table (vocab 96:
    # micro-batch 1 there, the command line's 2 otherwise)
    table = tmp_path / "layouts.json"
    table.write_text(json.dumps({"version": 1, "layouts": {"2": {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 1}}}))
    by_table = vocab == 96
    log = _run(script, None if by_table else 1, vocab, ["--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                                                        "4", *(["--tenplex-layout", str(table)] if by_table else [])])
    if by_table:
        assert f"> tenplex: --tenplex-layout {table}: tp=1,pp=1,dp=2, micro-batch 1 (from {table})" in log, log[-3000:]
    assert re.search(r"> tenplex: loaded iteration 4 from \S+: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2", log), \
        log[-3000:]
    if vocab == 96:
        assert (f"> tenplex: keeping the checkpoint's padded vocab {VOCAB_BASE + 128} (Megatron's rule at this TP: "
                f"{VOCAB_BASE + 112})") in log
    assert meta["padded_vocab_size"] == VOCAB_BASE + (96 if vocab == 95 else 128)  # the checkpoint of iteration 4
    lines = _log_lines(log)
    assert [(it, consumed) for it, consumed, _ in lines] == [(5, 40), (6, 48), (7, 56), (8, 64)], lines
    resumed = _losses(log)
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} restarted {resumed[it]:.6f}" for it in sorted(resumed))
    print(table)
    for it, loss in resumed.items():
        # printed to 7 significant digits; the unrolled second line carries 3 rounding errors
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it], table)
    meta = json.loads((ckpt / "iter_0000008" / "metadata.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2} and meta["iteration"] == 8
    assert meta["padded_vocab_size"] == VOCAB_BASE + (96 if vocab == 95 else 128)


# Megatron-LM's own save (no --tenplex): torch_dist with the distributed optimizer (dp_reshardable, its default), or
# the legacy torch format (one model_optim_rng.pt and one distrib_optim.pt per rank); and a mixture of experts at EP2
# in torch_dist (the chained optimizer's dense buffer and the experts' own, dp_reshardable) adopted at EP1 x DP2.
def _moe(dispatcher: str = "allgather") -> list[str]:
    """4 experts, top-2 routing, the load-balancing loss on. The bias-activation fusions need a GPU; megatron-core's
    expert MLP cannot add biases at EP1 x expert TP1, so none (as MoE recipes do)."""
    return ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", dispatcher,
            "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion"]


MOE, MOE_A2A = _moe(), _moe("alltoall")

OWN = {"torch_dist": (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "1"], "tp=2,pp=1,dp=1"),
       "torch": (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "1"], "tp=2,pp=1,dp=1"),
       "torch_dist-moe": ([*MOE, "--expert-model-parallel-size", "2"], [*MOE, "--expert-model-parallel-size", "1"],
                          "tp=1,pp=1,dp=2,ep=2")}


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("case", list(OWN))
def test_megatron_lm_own_checkpoint_adopted_at_another_layout(tmp_path, script: str, case: str) -> None:
    fmt, moe = case.split("-")[0], case.endswith("-moe")
    saving, adopting, layout = OWN[case]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    # the mixture of experts trains on uninterrupted to iteration 8 (its losses are the reference: Megatron-LM's
    # MoE at DP2 reads other samples than the dense TP2 reference), and its iteration-4 checkpoint is adopted
    log = _run(script, None, 95, [*saving, "--save", str(ckpt), "--save-interval", "4", "--ckpt-format", fmt,
                                  *([] if moe else ["--exit-interval", "4"])], tenplex=False)
    assert "> tenplex:" not in log, log[-3000:]
    ref = _losses(log) if moe else _reference(script, 95)
    it4 = ckpt / "iter_0000004"
    if fmt == "torch_dist":
        # core_v0.19 keeps the common state inside the .distcp files (no common.pt)
        assert list(it4.glob("*.distcp")) and ((it4 / "common.pt").exists() or RELEASE[:2] >= (0, 19)), \
            sorted(os.listdir(it4))
        assert json.loads((it4 / "metadata.json").read_text())["sharded_backend"] == "torch_dist"  # Megatron's
    else:
        assert sorted(os.listdir(it4)) == ["mp_rank_00", "mp_rank_01"], sorted(os.listdir(it4))
    if moe:  # Megatron-LM's default: the experts' sub-optimizer's own dp_reshardable buckets, one group per EP rank
        keys = read_dcp_metadata(str(it4)).tensors
        assert {k.split(".gbuf_idx_")[0] for k in keys if k.startswith("chained_1.optimizer.distributed.")} == \
            {f"chained_1.optimizer.distributed.dp_group_idx_{g}" for g in (0, 1)}, sorted(keys)
        (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    else:
        first = _losses(log)
        for it in range(1, 5):  # Megatron's own sampler at DP=1 reads the samples tenplex's does
            assert first[it] == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, first[it], ref[it])

    log = _run(script, None, 95, [*adopting, "--load", str(ckpt), "--save", str(out), "--save-interval", "4"])
    assert re.search(rf"> tenplex: loaded iteration 4 from \S+iter_0000004: layout {layout} -> tp=1,pp=1,dp=2", log), \
        log[-3000:]
    lines = _log_lines(log)
    assert [(it, consumed) for it, consumed, _ in lines] == [(5, 40), (6, 48), (7, 56), (8, 64)], lines
    resumed = _losses(log)
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} adopted {resumed[it]:.6f}" for it in sorted(resumed))
    print(table)
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it], table)
    meta = json.loads((out / "iter_0000008" / "metadata.json").read_text())
    assert meta["format"] == "tenplex-megatron" and meta["layout"] == {"tp": 1, "pp": 1, "dp": 2}
    assert meta["iteration"] == 8 and meta["consumed_samples"] == 64


# The way back: a tenplex checkpoint written under Megatron-LM with the hook, exported by `export-megatron` at another
# layout, loaded by Megatron-LM's own pretrain_gpt.py (the checkout's, unpatched) without --tenplex.
EXPORTS = {"tp1dp2-fully_reshardable": ("tp=1,pp=1,dp=2", ["--tensor-model-parallel-size", "1"], []),
           "pp2-fully_reshardable": ("tp=1,pp=2,dp=1", ["--tensor-model-parallel-size", "1",
                                                         "--pipeline-model-parallel-size", "2",
                                                         "--untie-embeddings-and-output-weights"],
                                     ["--untie-embeddings-and-output-weights"]),
           # --no-masked-softmax-fusion: with bf16 Megatron-LM picks the fused CUDA softmax kernel, absent on the CPU
           "tp1dp2-fully_reshardable-bf16": ("tp=1,pp=1,dp=2", ["--tensor-model-parallel-size", "1", "--bf16",
                                                             "--no-masked-softmax-fusion"],
                                          ["--bf16", "--no-masked-softmax-fusion"]),
           # a mixture of experts saved at TP2 x EP1 (one sub-optimizer) exported at EP2 (the experts' own)
           "ep2-fully_reshardable-moe": ("tp=1,pp=1,dp=2,ep=2", ["--tensor-model-parallel-size", "1", *MOE,
                                                                 "--expert-model-parallel-size", "2"],
                                         [*MOE, "--sequence-parallel"])}


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("case", list(EXPORTS))
def test_megatron_lm_loads_exported_checkpoint_without_the_plugin(tmp_path, script: str, case: str) -> None:
    """Megatron-LM with the hook saves a tenplex checkpoint at TP2 (iteration 4); the same job without --tenplex stops
    naming export-megatron; `export-megatron` writes it as Megatron's torch_dist at another layout; the checkout's own
    pretrain_gpt.py, without the patch, loads it there and iterations 5-8 equal the uninterrupted TP2 run's (bf16:
    the same checkpoint's resume with --tenplex at that layout, bf16 rounding depending on the layout)."""
    to, stock, model = EXPORTS[case]
    bf16 = "--bf16" in model
    ref = {} if bf16 else _reference(script, 95) if not model else _losses(_run(script, 2, 95, model))
    ckpt, out = tmp_path / "ckpt", tmp_path / "megatron"
    log = _run(script, 2, 95, [*model, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"])
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    log = _run(script, 1, 95, [*model, "--load", str(ckpt)], tenplex=False, ok=False)
    assert "export-megatron" in log and "megatron/training/checkpointing.py" not in log, log[-3000:]
    assert f"{ckpt}/iter_0000004 is a tenplex checkpoint" in log, log[-3000:]
    if bf16:  # the same checkpoint resumed with --tenplex at the export's layout (a TP2 run rounds bf16 otherwise)
        ref = _losses(_run(script, None, 95, [*stock, "--load", str(ckpt)]))
    fmt = case.split("-")[1]
    p = subprocess.run([sys.executable, "-m", "tenplex_megatron", "export-megatron", str(ckpt), str(out), "--to", to,
                        "--optimizer-format", fmt],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert f"iteration 4 written to {out}/iter_0000004 as Megatron torch_dist at {to} (distributed optimizer " \
           f"{fmt})" in p.stdout, p.stdout[-3000:]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    meta = json.loads((out / "iter_0000004" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist", meta
    stock_script = os.path.join(MLM, "pretrain_gpt.py")  # the checkout's own, unpatched: no hook is installed
    # no --save: saving is not what this test is about (Megatron-LM's own save: own_checkpoint_adopted)
    log = _run(stock_script, None, 95, [*stock, "--load", str(out)], tenplex=False)
    assert "> tenplex" not in log, log[-3000:]
    assert re.search(r"successfully loaded checkpoint from \S+ \[.*\] at iteration 4", log), \
        log[-3000:]
    lines = _log_lines(log)
    assert [(it, consumed) for it, consumed, _ in lines] == [(5, 40), (6, 48), (7, 56), (8, 64)], lines
    resumed = _losses(log)
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} exported {resumed[it]:.6f}" for it in sorted(resumed))
    print(table)
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it], table)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(script: str, tmp: pathlib.Path, run_id: str, nodes: list[str], tp: int, extra: list[str],
               load: bool = True) -> str:
    """Two torchrun agents on localhost (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous), one per node, each
    with its own memory directory ``tmp/mem_<node>``; returns both logs, joined."""
    import torch

    port = _free_port()
    procs = []
    path = os.pathsep.join([os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or "",
                            os.environ.get("PATH", "")])
    extra_path = os.environ.get("PYTHONPATH")
    cpu = not torch.cuda.is_available()
    for node in nodes:
        env = dict(os.environ, PYTHONPATH=f"{MLM}:{ROOT}" + (f":{extra_path}" if extra_path else ""), PATH=path,
                   OMP_NUM_THREADS="1", **NVRX_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8", NCCL_ALGO="Ring",
                   CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   TENPLEX_OPEN_LOG=str(tmp / f"open_{node}.log"), **({"TORCH_COMPILE_DISABLE": "1"} if cpu else {}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, RUNNER, script,
               *FLAGS, "--tenplex", *(["--distributed-backend", "gloo"] if cpu else []), "--vocab-size",
               _vocab_flag(95), "--tensor-model-parallel-size", str(tp), "--save", str(tmp / "ckpt"),
               *(["--load", str(tmp / "ckpt")] if load else []),
               "--save-interval", "2", "--tenplex-memory", str(tmp / f"mem_{node}"), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp / f"{run_id}_{node}.log", "w"),
                                      stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp / f"{run_id}_{node}.log").read_text() for node in nodes]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    return "\n".join(logs)


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
def test_megatron_lm_restarts_from_peer_memory_at_another_layout_after_losing_a_node(tmp_path, script: str) -> None:
    """Megatron-LM's own loop with --tenplex-memory on two nodes (K=2): snapshots at 2, 4, 6 (4 persisted too;
    replication paced by --tenplex-replication-rate auto, hurried at the exit), exit at 6; node b is lost and node c joins with empty memory; the restart at TP1 x DP2 loads snapshot 6 from node a's
    memory (c's rank receives its part), reads nothing of the durable checkpoint (made unreadable), continues the
    uninterrupted TP2 run's losses, and persists the last state when training is over."""
    ref = _reference(script, 95)
    log = _run_nodes(script, tmp_path, "first", ["a", "b"], 2, ["--exit-interval", "6", "--tenplex-persist-interval",
                                                                 "2", "--tenplex-replication-rate", "auto"])
    assert "> tenplex: snapshot of iteration 6 in host memory" in log, log[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000004", "latest_checkpointed_iteration.txt",
                                                     "tenplex-lease"]
    for node in ("a", "b"):  # both nodes hold both ranks' files of snapshot 6
        assert sorted(os.listdir(tmp_path / f"mem_{node}" / "iter_0000006")) == \
            ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]
    first = _losses(log)
    for it in range(1, 7):
        assert first[it] == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, first[it], ref[it])

    shutil.rmtree(tmp_path / "mem_b")  # node b is lost; node c joins with empty memory
    durable = tmp_path / "ckpt" / "iter_0000004"
    shards = [durable / n for n in os.listdir(durable) if n.endswith(".safetensors")]
    for p in shards:
        os.chmod(p, 0)  # a read of the durable checkpoint's tensors would fail
    try:
        log = _run_nodes(script, tmp_path, "second", ["a", "c"], 1, [])
    finally:
        for p in shards:
            os.chmod(p, 0o644)
    assert re.search(r"> tenplex: loaded iteration 6 from host memory \(\S+\): layout tp=2,pp=1,dp=1 -> "
                     r"tp=1,pp=1,dp=2", log), log[-3000:]
    assert "0 bytes read from durable storage" in log
    lines = _log_lines(log)
    assert [(it, consumed) for it, consumed, _ in lines] == [(7, 56), (8, 64)], lines
    resumed = _losses(log)
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])
    # training is over: its last state was persisted to --save
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    meta = json.loads((tmp_path / "ckpt" / "iter_0000008" / "metadata.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2} and meta["consumed_samples"] == 64
    # started again without --load (afresh, Megatron-LM never calls load_checkpoint): the first save discards
    # the older run's snapshots, so a later restart cannot jump to that run's iteration 8
    _run_nodes(script, tmp_path, "third", ["a", "c"], 1, ["--train-iters", "4", "--tenplex-persist-interval", "1000"],
               load=False)
    for node in ("a", "c"):
        kept = directory.committed_iterations(str(tmp_path / f"mem_{node}"))
        assert kept and max(kept) == 4, (node, kept)
    for node in ("a", "b", "c"):  # no process opened a file in another node's memory directory
        opened = [line.split("\t", 1)[1] for line in (tmp_path / f"open_{node}.log").read_text().splitlines()]
        assert opened and all(p.startswith(str(tmp_path / f"mem_{node}") + os.sep) for p in opened), (node, opened)


#: What GPU runs turn on, and the plain optimizer, through Megatron-LM's own loop and parser: name -> (flags of the
#: uninterrupted run and of the save, flags of the restart). The restart keeps --sequence-parallel on its command line at TP 1 (Megatron-LM
#: turns it off there); the interleaved run has one layer per virtual stage (4 layers, PP2 x VPP2); fp16's scaler
#: starts at 1024 and doubles every 2 steps, far from overflow (its state must come back for the scale to go on).
GPU_FLAGS = {
    "sp-TP2-TP1DP2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                      ["--tensor-model-parallel-size", "1", "--sequence-parallel"]),
    "vpp-PP2VPP2-TP2": (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"],
                        ["--num-layers", "4", "--tensor-model-parallel-size", "2"]),
    # --no-masked-softmax-fusion: with fp16 Megatron-LM picks the fused CUDA softmax kernel, absent on the CPU
    "fp16-TP2-TP1DP2": (["--tensor-model-parallel-size", "2", "--fp16", "--initial-loss-scale", "1024",
                         "--loss-scale-window", "2", "--no-masked-softmax-fusion"],
                        ["--tensor-model-parallel-size", "1", "--fp16", "--initial-loss-scale", "1024",
                         "--loss-scale-window", "2", "--no-masked-softmax-fusion"]),
    # without --use-distributed-optimizer: each rank's optimizer holds every parameter of its model shard
    "plain-TP2-TP1DP2": ([PLAIN_OPTIMIZER, "--tensor-model-parallel-size", "2"],
                         [PLAIN_OPTIMIZER, "--tensor-model-parallel-size", "1"]),
}


def _restart_oracle(script: str, tmp_path: pathlib.Path, a: list[str], b: list[str], nproc: int = 2,
                    rel: float = 1e-5) -> tuple[dict, dict, str]:
    """Train at A (flags ``a``) uninterrupted; train at A again saving at iteration 4 with --tenplex and exit; restart
    at B (flags ``b``), saving at iteration 8. Iterations 5-8 must equal the uninterrupted run's. Returns the
    metadata of both checkpoints (iteration 4 at A, 8 at B) and the restart's log."""
    ref = _losses(_run(script, None, 95, a, nproc=nproc))
    assert sorted(ref) == list(range(1, 9)) and all(loss == loss for loss in ref.values()), ref  # no NaN
    ckpt = tmp_path / "ckpt"
    log = _run(script, None, 95, [*a, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"],
               nproc=nproc)
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    log = _run(script, None, 95, [*b, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4"], nproc=nproc)
    assert re.search(r"> tenplex: loaded iteration 4 from \S+", log), log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8], log[-3000:]
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} restarted {resumed[it]:.6f}" for it in sorted(resumed))
    print(table)
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=rel, abs=5e-6), (it, loss, ref[it], table)
    metas = [json.loads((ckpt / f"iter_000000{it}" / "metadata.json").read_text()) for it in (4, 8)]
    return metas[0], metas[1], log


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("name", list(GPU_FLAGS))
def test_megatron_lm_gpu_flags_restart_continues_losses(tmp_path, script: str, name: str) -> None:
    """Sequence parallelism, an interleaved pipeline, fp16 with loss scaling and the plain optimizer under Megatron-LM:
    train at A and save at iteration 4 with --tenplex, restart at B, and iterations 5-8 equal the uninterrupted run
    at A."""
    a, b = GPU_FLAGS[name]
    meta, meta_b, _ = _restart_oracle(script, tmp_path, a, b, rel=1e-4 if "--fp16" in a else 1e-5)
    assert meta["layout"].get("sp", False) == ("--sequence-parallel" in a)
    assert meta["layout"].get("vpp", 1) == (2 if "--num-layers-per-virtual-pipeline-stage" in a else 1)
    for m in (meta, meta_b):
        assert m["use_distributed_optimizer"] == (PLAIN_OPTIMIZER not in a), m["use_distributed_optimizer"]


#: uneven pipeline stages (Megatron-LM's flags, handed to megatron-core as given): 4 layers, 3 on the first rank
UNEVEN = {
    "uneven-PP2first3-DP2": (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                              "--decoder-first-pipeline-num-layers", "3"], ["--num-layers", "4"], [3, 1], None),
    "uneven-DP2-PP2last3": (["--num-layers", "4"], ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                                    "--decoder-last-pipeline-num-layers", "3"], None, [1, 3]),
}


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("name", list(UNEVEN))
def test_megatron_lm_uneven_pipeline_restart_continues_losses(tmp_path, script: str, name: str) -> None:
    """An uneven pipeline under Megatron-LM: saved at one split, restarted at another layout (or the reverse), and
    iterations 5-8 equal the uninterrupted run; each checkpoint records its split (none: even)."""
    a, b, split_a, split_b = UNEVEN[name]
    meta, meta_b, _ = _restart_oracle(script, tmp_path, a, b)
    assert meta["layout"].get("split") == split_a and meta_b["layout"].get("split") == split_b


def _transformer_engine_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.skipif(_transformer_engine_importable(), reason="Transformer Engine is installed: nothing to refuse")
def test_megatron_lm_transformer_engine_spec_without_transformer_engine_refused_at_start(tmp_path,
                                                                                        script: str) -> None:
    """Megatron-LM's default --transformer-impl transformer_engine where Transformer Engine is not installed: without
    the hook Megatron-LM stops while it builds the model (core_v0.16.1: NameError on TESpecProvider); with --tenplex
    the hook refuses it at start, on every rank, naming the flag and both ways on, before any iteration or save."""
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, ["--transformer-impl", "transformer_engine", "--save", str(ckpt), "--load", str(ckpt)],
               ok=False)
    want = ("pretrain_gpt.py: with --tenplex, --transformer-impl transformer_engine (Megatron-LM's default): "
            "Transformer Engine cannot be imported")
    assert log.count(want) == 2, log[-3000:]  # both ranks
    assert "pass --transformer-impl local" in log, log[-3000:]
    assert "TESpecProvider" not in log and not _log_lines(log), log[-3000:]
    assert not ckpt.exists() or not os.listdir(ckpt), sorted(os.listdir(ckpt))


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # megatron-core needs SP with MoE at TP > 1


def _ep(ep: int, etp: int | None = None) -> list[str]:
    return ["--expert-model-parallel-size", str(ep),
            *(["--expert-tensor-parallel-size", str(etp)] if etp is not None else [])]


#: A mixture of experts restarted at another EP, expert TP, TP or PP under Megatron-LM: name -> (ranks, flags at A,
#: flags at B, layout A, layout B as the checkpoints record them; ParallelLayout.parse's spelling).
MOE_CASES = {
    # the experts' own sub-optimizer (EP > 1) joins the dense one, and back
    "moe-EP2-EP1DP2": (2, [*MOE, *_ep(2)], [*MOE, *_ep(1)], "tp=1,pp=1,dp=2,ep=2", "tp=1,pp=1,dp=2"),
    "moe-EP1DP2-EP2": (2, [*MOE, *_ep(1)], [*MOE, *_ep(2)], "tp=1,pp=1,dp=2", "tp=1,pp=1,dp=2,ep=2"),
    # each stage gets its own layers' experts
    "moe-EP2-PP2EP1": (2, [*MOE, *_ep(2)], [*MOE, *_ep(1), "--pipeline-model-parallel-size", "2"],
                       "tp=1,pp=1,dp=2,ep=2", "tp=1,pp=2,dp=1"),
    # experts cut along their FFN dimension by TP (expert TP = TP)
    "moe-EP2-TP2EP1": (2, [*MOE, *_ep(2)], [*MOE, *_ep(1), *TP2_SP], "tp=1,pp=1,dp=2,ep=2", "tp=2,pp=1,dp=1,sp"),
    # expert TP 2 -> 1 at TP 2: the experts whole again, spread over EP 2
    "moe-ETP2-ETP1EP2": (2, [*MOE, *TP2_SP, *_ep(1, 2)], [*MOE, *TP2_SP, *_ep(2, 1)], "tp=2,pp=1,dp=1,sp",
                         "tp=2,pp=1,dp=1,sp,ep=2,etp=1"),
    # the same restart with EP and expert TP left to the hook's --tenplex-layout auto (TP 2 given): it chooses the
    # experts whole over EP 2 (plan/autolayout.py: cheaper than expert TP's gathers) and Megatron-LM builds that
    "moe-ETP2-auto": (2, [*MOE, *TP2_SP, *_ep(1, 2)], [*MOE, *TP2_SP, "--tenplex-layout", "auto"],
                      "tp=2,pp=1,dp=1,sp", "tp=2,pp=1,dp=1,sp,ep=2,etp=1"),
    # 4 ranks: EP2 x expert DP2 -> EP4, the alltoall dispatcher
    "moe-EP2DP2-EP4": (4, [*MOE_A2A, *_ep(2)], [*MOE_A2A, *_ep(4)], "tp=1,pp=1,dp=4,ep=2", "tp=1,pp=1,dp=4,ep=4"),
}


def _check_experts(meta: dict, layout: str, nproc: int) -> None:
    """The checkpoint records ``layout`` (EP and expert TP included) and every expert of both layers once, in full,
    saved by the ranks the layout spreads the experts over."""
    want = ParallelLayout.parse(layout)
    assert meta["layout"] == want.to_json(), (meta["layout"], layout)
    assert meta["model"]["num_experts"] == 4
    summary = expert_summary(PTC.from_json(meta["ptc"]), meta["layout"])
    assert summary is not None and summary.complete, summary
    assert (summary.num_experts, summary.ep, summary.expert_tp) == (4, want.ep, want.expert_tp)
    fc1 = [c for c in meta["ptc"]["chunks"] if c["key"] == "decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    # (layer, expert) pieces: each expert cut into expert-TP pieces along its FFN dimension, saved once
    pieces = sorted((c["offsets"][0], c["offsets"][1], c["offsets"][2]) for c in fc1)
    assert len(pieces) == len(set(pieces)) == 2 * 4 * want.expert_tp, pieces
    assert {(la, e) for la, e, _ in pieces} == {(la, e) for la in range(2) for e in range(4)}
    # the writers: the ranks of each (expert TP, EP, PP) coordinate hold their own pieces (expert DP replicas share
    # the writing), so at least that many ranks wrote experts: no rank gathered them
    assert len({c["at"]["rank"] for c in fc1}) >= want.expert_tp * want.ep * want.pp, fc1


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_megatron_lm_moe_restart_continues_losses(tmp_path, script: str, name: str) -> None:
    """A mixture of experts (4 experts, top-2, the load-balancing loss on) under Megatron-LM at a new EP, expert TP,
    TP or PP: train at A and save at iteration 4 with --tenplex, restart at B (saving at 8); iterations 5-8 equal the
    uninterrupted run at A, the restart logs A -> B, and both checkpoints record their layout and every expert."""
    nproc, a, b, layout_a, layout_b = MOE_CASES[name]
    meta_a, meta_b, log = _restart_oracle(script, tmp_path, a, b, nproc=nproc)
    assert f": layout {ParallelLayout.parse(layout_a)} -> {ParallelLayout.parse(layout_b)}, " in log, log[-3000:]
    if "auto" in b:  # the hook's choice, logged with the expert layout spelled out
        assert "> tenplex: --tenplex-layout auto: tp=2,pp=1,dp=1,sp,ep=2,etp=1, micro-batch 2, expert TP 1 x EP 2 x " \
               "expert DP 1 (auto: best of " in log, log[-3000:]
    _check_experts(meta_a, layout_a, nproc)
    _check_experts(meta_b, layout_b, nproc)


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
def test_megatron_lm_falls_back_past_a_damaged_checkpoint(tmp_path, script: str) -> None:
    """Megatron-LM with the hook: the newest checkpoint's rank file has a flipped byte, so the restart (at another
    layout) skips it with one warning naming the file, loads the previous complete one, and continues the
    uninterrupted run's losses from there (Megatron-LM #5281 looped on NaN instead)."""
    ref = _reference(script, 95)
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "4"])
    assert "> tenplex: saved iteration 2" in log and "> tenplex: saved iteration 4" in log, log[-3000:]
    bad = ckpt / "iter_0000004" / directory.rank_file_name(1)
    flip(str(bad))
    log = _run(script, 1, 95, ["--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4"])
    assert log.count("skipping a damaged copy") == 1 and str(bad) in log, log[-3000:]
    assert re.search(r"> tenplex: loaded iteration 2 from \S+iter_0000002: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2",
                     log), log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8], log[-3000:]
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
def test_megatron_lm_async_save_is_written_in_the_background_and_resumes_at_another_layout(tmp_path,
                                                                                         script: str) -> None:
    """Megatron-LM's --async-save with the hook: each save is a snapshot into the node's memory (in /dev/shm, one
    directory per --save), written to --save by the helper in the background and committed before the next save
    and at exit; with the memory gone, the restart at TP1 x DP2 loads the durable checkpoint and continues the
    uninterrupted run's losses. The reference is stock Megatron-LM: the same script and flags without ``--tenplex``,
    ``--async-save`` included (Megatron-LM's own async torch_dist save, its background writer; it runs on the CPU
    too), every checkpoint of which it writes."""
    from tenplex_megatron.frontdoor.memory_flags import async_save_dir

    stock_dir = tmp_path / "stock"
    stock = _run(script, 2, 95, ["--save", str(stock_dir), "--save-interval", "2", "--async-save"], tenplex=False)
    assert "> tenplex" not in stock, stock[-3000:]
    assert (stock_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "8", stock[-3000:]
    for it in (2, 4, 6, 8):  # Megatron-LM's own format, finalized by its own async writer
        assert list((stock_dir / f"iter_{it:07d}").glob("*.distcp")), (it, stock[-3000:])
    ref = _losses(stock)
    assert sorted(ref) == list(range(1, 9)), stock[-3000:]
    ckpt = tmp_path / "ckpt"
    mem = async_save_dir(str(ckpt))
    try:
        log = _run(script, 2, 95, ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "4",
                                   "--async-save"])
        assert "snapshot of iteration 4 in host memory" in log and "persisting in the background" in log, log[-3000:]
        assert directory.committed_iterations(str(ckpt)) == [2, 4], log[-3000:]
        shutil.rmtree(mem)  # the node's memory is gone: the restart reads the durable checkpoint
        log = _run(script, 1, 95, ["--load", str(ckpt)])
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    assert re.search(r"> tenplex: loaded iteration 4 from \S+iter_0000004: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2",
                     log), log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8], log[-3000:]
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])


def _plain_torchrun(script: str, nproc: int, out: pathlib.Path, extra: list[str], restarts: int = 0) -> subprocess.Popen:
    """Megatron-LM's pretrain_gpt.py with the hook under ``torchrun --nproc_per_node N --master-port P`` without
    --rdzv-id (run id ``none``: the launch line of Megatron-LM's examples), its output into ``out``."""
    env, cpu = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port",
           str(_free_port()), "--max-restarts", str(restarts), "--monitor-interval", "0.5", RUNNER, script, *FLAGS,
           "--tenplex", *(["--distributed-backend", "gloo"] if cpu else []), "--vocab-size", _vocab_flag(95), *extra]
    return subprocess.Popen(cmd, env=dict(env, PYTHONUNBUFFERED="1"), stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _until(what: str, ok: Callable[[], bool], log: pathlib.Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ok():
        if time.time() > deadline:
            raise AssertionError(f"{what} not after {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
def test_megatron_lm_second_plain_torchrun_refused_restart_takes_the_next_generation(tmp_path, script: str) -> None:
    """Megatron-LM's own loop, job A and job B both plain torchrun launches without --rdzv-id on one --save: B is
    refused before any process group, naming the directory, A's holder and --tenplex-take-over; A trains on and
    its newest checkpoint verifies; A's worker killed, its agent restarts it, and the new round takes the next
    generation at once as the same job and trains on."""
    from tenplex_megatron.storage import lease
    from tenplex_megatron.storage.verify_ckpt import verify_checkpoint

    ckpt, a_log, b_log = tmp_path / "ckpt", tmp_path / "a.log", tmp_path / "b.log"
    # one process each: torch 2.13's static rendezvous keeps its store across restart rounds, and a restarted group
    # of several processes can read a peer's address of the previous round and fail to connect (seen here, gloo)
    a = _plain_torchrun(script, 1, a_log, ["--train-iters", "100000", "--save", str(ckpt), "--load", str(ckpt),
                                           "--save-interval", "2"], restarts=1)
    try:
        _until("A's first checkpoint", lambda: bool(directory.committed_iterations(str(ckpt))), a_log)
        held = lease.current(str(ckpt))
        assert held.job.startswith("torchrun-"), held
        b = _plain_torchrun(script, 1, b_log, ["--train-iters", "100000", "--save", str(ckpt), "--load", str(ckpt),
                                               "--save-interval", "2"])
        assert b.wait(timeout=600) != 0
        out = b_log.read_text()
        assert f"{ckpt} is held by job {held.job!r} (generation {held.generation}, holder {held.holder})" in out, \
            out[-4000:]
        assert "--tenplex-take-over" in out and not _log_lines(out), out[-4000:]  # refused at start: no iteration
        assert lease.current(str(ckpt)).generation == held.generation  # nothing written by the refused job
        after_b = max(directory.committed_iterations(str(ckpt)))
        _until("A's next checkpoint", lambda: max(directory.committed_iterations(str(ckpt))) > after_b, a_log)
        newest = max(directory.committed_iterations(str(ckpt)))
        assert verify_checkpoint(str(ckpt / directory.iter_dir_name(newest)), workers=1).ok  # A unharmed
        # an elastic restart of A: a worker SIGKILLed, the agent restarts the group, the new round the same job
        (worker,) = psutil.Process(a.pid).children()
        worker.send_signal(signal.SIGKILL)
        _until("the restarted round's lease", lambda: lease.current(str(ckpt)).generation > held.generation, a_log)
        restarted = lease.current(str(ckpt))
        assert restarted.generation == held.generation + 1 and restarted.job == held.job, restarted
        resumed_from = max(directory.committed_iterations(str(ckpt)))
        _until("a checkpoint of the restarted round",
               lambda: max(directory.committed_iterations(str(ckpt))) > resumed_from, a_log)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    log = a_log.read_text()
    assert "took the lease over" not in log and "is held by" not in log, log[-4000:]
    newest = max(directory.committed_iterations(str(ckpt)))
    assert verify_checkpoint(str(ckpt / directory.iter_dir_name(newest)), workers=1).ok


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")
def test_megatron_lm_ckpt_step_and_finetune_at_another_layout(tmp_path, script: str) -> None:
    """Megatron-LM's --ckpt-step and --finetune under --tenplex (plan/megatron_ckpt_flags.py), at TP1 x DP2 from a
    TP2 run that saved iterations 4 and 8: --ckpt-step 4 continues iteration 4's losses (5-8 equal the run's own);
    --finetune takes iteration 8's weights alone and starts at iteration 0 with a fresh data position, and trains
    alike at TP2 and TP1 x DP2."""
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, ["--save", str(ckpt), "--save-interval", "4"])
    ref = _losses(log)
    assert sorted(ref) == list(range(1, 9)) and (ckpt / "iter_0000008").is_dir(), log[-3000:]

    log = _run(script, 1, 95, ["--load", str(ckpt), "--ckpt-step", "4"])
    assert re.search(r"> tenplex: loaded iteration 4 from \S+iter_0000004: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2",
                     log), log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8], log[-3000:]
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])

    tuned = {}
    for tp in (2, 1):
        log = _run(script, tp, 95, ["--load", str(ckpt), "--finetune", "--train-iters", "3"])
        assert re.search(r"> tenplex: loaded iteration 0 from \S+iter_0000008: .*fine-tune", log), log[-3000:]
        lines = _log_lines(log)
        assert [(it, consumed) for it, consumed, _ in lines] == [(1, 8), (2, 16), (3, 24)], lines
        tuned[tp] = _losses(log)
    for it in (1, 2, 3):
        assert tuned[1][it] == pytest.approx(tuned[2][it], rel=1e-5, abs=5e-6), (it, tuned)
    assert tuned[2][1] < ref[1]  # iteration 8's weights: lower than the first step from scratch
