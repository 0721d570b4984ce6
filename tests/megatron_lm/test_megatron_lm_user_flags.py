"""Opt-in: flags a Megatron-LM user expects, honoured under --tenplex through Megatron-LM's own pretrain_gpt.py.

- ``--use-checkpoint-args``: a restart at TP1 x DP2 with the model flags left out takes them from the tenplex
  checkpoint's metadata.json and continues the uninterrupted TP2 run's losses.
- ``--no-save-optim --no-save-rng`` with ``--tenplex-memory``: the snapshot and its durable copy hold no optimizer
  state and no RNG, marked weights-only; a restart that wants the optimizer is refused naming the flags, one with
  ``--no-load-optim`` loads them and trains on.
- ``--exit-signal-handler --num-workers 1``: the training split's DataLoader is Megatron-LM's own (its
  ``worker_init_fn`` in the worker) with tenplex's sampler; a restart at TP1 x DP2 continues the losses.
- Evaluation: the validation split is Megatron-LM's own loader (from core_v0.18 at ``--eval-global-batch-size``);
  its position is restored, and the validation losses after the restart at TP1 x DP2 equal the uninterrupted run's.
  ``--eval-micro-batch-size`` other than ``--micro-batch-size`` is not run: at TP > 1 core_v0.19's own
  ``pretrain_gpt.py`` receives each batch at the training micro-batch size (a broadcast of the wrong size, with or
  without --tenplex).
- ``--full-validation`` with ``--multiple-validation-sets`` (one set) on a small indexed dataset: the validation
  and training losses after TP1 x DP2 -> DP1 equal the uninterrupted run's. Without ``--multiple-validation-sets``
  Megatron-LM's own run stops at its first evaluation, with or without --tenplex (core_v0.16.1 and core_v0.19.0:
  ``evaluate_and_print_results`` indexes the int it broadcast, "'int' object is not subscriptable"; at TP > 1
  first ``build_train_valid_test_data_iterators``' len() of a TP rank's None loader); ``--mock-data`` takes the split
  1,1,1 whatever ``--split`` says, about a million validation samples.

Each Megatron-LM launch takes minutes on a CPU-only machine: run one test with ``-k``.
"""

from __future__ import annotations

import json
import re

import pytest

from tenplex_megatron.storage import directory
from tests.harness import read_full_tensors
from tests.megatron_lm.test_megatron_lm import (
    FLAGS,
    MLM,
    RELEASE,
    _log_lines,
    _losses,
    _reference,
    _run,
    patched_script,
)

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]

#: the model's flags in FLAGS (each with its value): what --use-checkpoint-args takes from the checkpoint
MODEL = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings")
CLOSE = {"rel": 1e-5, "abs": 5e-6}


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> str:
    return patched_script(tmp_path_factory.mktemp("mlm-user-flags"))


def _without_model(flags: list[str]) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in MODEL:
            skip = True
        else:
            out.append(f)
    return out


def _equal(resumed: dict[int, float], ref: dict[int, float], what: str) -> None:
    table = "\n".join(f"{it}: uninterrupted {ref[it]:.6f} {what} {resumed[it]:.6f}" for it in sorted(resumed))
    print(table)
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], **CLOSE), (it, loss, ref[it], table)


def test_use_checkpoint_args_restart_at_another_layout_without_model_flags(tmp_path, script: str) -> None:
    ref = _reference(script, 95)
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"])
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    model = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"], model["seq_length"]) == \
        (2, 64, 4, 64), model
    base = _without_model(FLAGS)
    assert not set(MODEL) & set(base)
    log = _run(script, 1, 95, ["--load", str(ckpt), "--use-checkpoint-args"], base=base)
    assert re.search(r"> tenplex: --use-checkpoint-args: \d+ model flags from \S+iter_0000004 \(iteration 4\); the "
                     r"layout is the command line's", log), log[-3000:]
    assert re.search(r"> tenplex: loaded iteration 4 from \S+: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2", log), \
        log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8], log[-3000:]
    _equal(resumed, ref, "--use-checkpoint-args")


def test_no_save_optim_with_tenplex_memory_snapshot_holds_no_optimizer(tmp_path, script: str) -> None:
    ckpt, mem = tmp_path / "ckpt", tmp_path / "mem"
    log = _run(script, 2, 95, ["--save", str(ckpt), "--save-interval", "4", "--tenplex-memory", str(mem),
                               "--tenplex-persist-interval", "1", "--no-save-optim", "--no-save-rng"])
    assert "> tenplex: snapshot of iteration 8 in host memory" in log, log[-3000:]
    for copy in (mem / "iter_0000008", ckpt / "iter_0000008"):  # the snapshot and its durable copy
        meta = json.loads((copy / "metadata.json").read_text())
        assert meta["weights_only"] is True and meta["optimizer"] is None and meta["scheduler"] is None, copy
        assert not meta.get("rng"), (copy, meta.get("rng"))
        keys = directory.read_checkpoint_metadata(str(copy)).ptc.tensors
        assert keys and not [k for k in keys if k.startswith("optimizer.")], (copy, sorted(keys))
        assert not [k for k in read_full_tensors(str(copy)) if k.startswith("optimizer.")], copy
    # a restart that wants the optimizer: the snapshot in memory is refused naming the flags
    log = _run(script, 1, 95, ["--load", str(ckpt), "--save", str(ckpt), "--tenplex-memory", str(mem),
                               "--save-interval", "4", "--train-iters", "10"], ok=False)
    assert "holds the weights only (saved with --no-save-optim): load it with --no-load-optim" in log, log[-3000:]
    log = _run(script, 1, 95, ["--load", str(ckpt), "--save", str(ckpt), "--tenplex-memory", str(mem),
                               "--save-interval", "4", "--train-iters", "10", "--no-load-optim"])
    assert re.search(r"> tenplex: loaded iteration 8 from \S+iter_0000008: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2.*"
                     r"optimizer and LR schedule left fresh", log), log[-3000:]
    lines = _log_lines(log)
    assert [(it, consumed) for it, consumed, _ in lines] == [(9, 72), (10, 80)], lines
    assert all(loss == loss for _, _, loss in lines), lines  # no NaN


def test_exit_signal_handler_with_a_worker_restart_continues_losses(tmp_path, script: str) -> None:
    ref = _reference(script, 95)  # two workers (Megatron-LM's default), no handler: the same samples
    flags = ["--exit-signal-handler", "--num-workers", "1"]
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, [*flags, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"])
    assert "> tenplex: saved iteration 4" in log, log[-3000:]
    _equal({it: loss for it, loss in _losses(log).items()}, ref, "first run")
    log = _run(script, 1, 95, [*flags, "--load", str(ckpt)])
    assert re.search(r"> tenplex: loaded iteration 4 from \S+: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2", log), \
        log[-3000:]
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8], log[-3000:]
    _equal(resumed, ref, "restarted")


VALID = re.compile(r"validation(?:-\S+)? loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")  # -0: a set


def _valid(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in VALID.finditer(log)}


def test_eval_batch_sizes_and_validation_position_across_a_restart(tmp_path, script: str) -> None:
    """Evaluation every 2 iterations (2 steps each); from core_v0.18 at its own global batch size (4).
    The validation losses at 6 and 8 after a restart at 4 at TP1 x DP2 equal the uninterrupted TP2 run's, as do
    the training losses."""
    ev = ["--eval-iters", "2", "--eval-interval", "2",
          *(["--eval-global-batch-size", "4"] if RELEASE[:2] >= (0, 18) else [])]
    ref_log = _run(script, 2, 95, ev)
    ref, ref_valid = _losses(ref_log), _valid(ref_log)
    assert sorted(ref_valid) == [2, 4, 6, 8], ref_log[-3000:]
    ckpt = tmp_path / "ckpt"
    log = _run(script, 2, 95, [*ev, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"])
    extra = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())["extra"]
    eval_gbs = 4 if RELEASE[:2] >= (0, 18) else 8
    assert extra["consumed_valid_samples"] == 2 * 2 * eval_gbs, extra
    log = _run(script, 1, 95, [*ev, "--load", str(ckpt)])
    resumed, valid = _losses(log), _valid(log)
    assert sorted(resumed) == [5, 6, 7, 8] and sorted(valid) == [6, 8], log[-3000:]
    _equal(resumed, ref, "restarted")
    _equal(valid, ref_valid, "restarted (validation)")


#: --full-validation's data: 100 documents of 191 bytes (192 byte-level tokens with the end of document), split
#: 97/3/0: the validation split is 3 x 192 tokens, (576 - 1) // 64 = 8 samples of --seq-length 64, an even count,
#: so each DP2 rank reads 4 and every evaluation covers the split a whole number of times at DP2 and at DP1 alike
FULL_DOCS, FULL_DOC_BYTES, FULL_SPLIT = 100, 191, "97,3,0"


def _full_validation_data(tmp_path) -> list[str]:
    """FLAGS with --mock-data replaced by a small indexed dataset (``scripts/build_dataset.py``'s byte-level
    tokenizer: ids below 257, in the vocabulary of --vocab-size 300) and the split above."""
    import importlib.util
    import os

    from tests.harness import ROOT

    spec = importlib.util.spec_from_file_location("build_dataset", os.path.join(ROOT, "scripts", "build_dataset.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    docs = [(f"document {i} " * 40)[:FULL_DOC_BYTES] for i in range(FULL_DOCS)]
    prefix, tokens = mod.build(docs, str(tmp_path / "data" / "docs"))
    assert tokens == FULL_DOCS * (FULL_DOC_BYTES + 1), tokens
    return [f for f in FLAGS if f != "--mock-data"] + ["--data-path", prefix, "--split", FULL_SPLIT]


def test_full_validation_across_a_restart(tmp_path, script: str) -> None:
    """--full-validation (each evaluation the whole validation split, Megatron-LM's own sampler) with
    --multiple-validation-sets (one set): TP1 x DP2 saving at 4, restarted at DP1 on one process; the validation
    losses at 6 and 8 and the training losses equal the uninterrupted DP2 run's. Without --multiple-validation-sets
    Megatron-LM's own run stops at its first evaluation, with or without --tenplex (core_v0.16.1, core_v0.19.0:
    ``evaluate_and_print_results`` indexes the int it broadcast); at TP > 1 the sampler's one-sample micro-batches
    are not the size pretrain_gpt.py broadcasts to the other TP ranks (--micro-batch-size)."""
    base = _full_validation_data(tmp_path)
    ev = ["--eval-iters", "2", "--eval-interval", "2", "--full-validation", "--multiple-validation-sets",
          *(["--eval-global-batch-size", "4"] if RELEASE[:2] >= (0, 18) else [])]
    ref_log = _run(script, 1, 300, ev, base=base)
    ref, ref_valid = _losses(ref_log), _valid(ref_log)
    assert sorted(ref) == list(range(1, 9)) and sorted(ref_valid) == [2, 4, 6, 8], ref_log[-3000:]
    assert "validation-0 loss at iteration 2" in ref_log, ref_log[-3000:]  # the set's line: full validation's path
    ckpt = tmp_path / "ckpt"
    _run(script, 1, 300, [*ev, "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4"], base=base)
    log = _run(script, 1, 300, [*ev, "--load", str(ckpt)], base=base, nproc=1)
    assert re.search(r"> tenplex: loaded iteration 4 from \S+: layout tp=1,pp=1,dp=2 -> tp=1,pp=1,dp=1", log), \
        log[-3000:]
    resumed, valid = _losses(log), _valid(log)
    assert sorted(resumed) == [5, 6, 7, 8] and sorted(valid) == [6, 8], log[-3000:]
    _equal(resumed, ref, "restarted")
    _equal(valid, ref_valid, "restarted (validation)")
