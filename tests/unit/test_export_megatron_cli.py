"""``export-megatron``'s bad input refused before anything is written (no process is started), and a job without
``--tenplex`` whose ``--load`` holds tenplex checkpoints refused naming ``export-megatron``: the checkpoint it would
meet is the one Megatron's tracker names, or the newest when there is no Megatron checkpoint to load instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tenplex_megatron import cli
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.frontdoor import restart_sources
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.directory import TRACKER_FILE
from tests.harness import ROOT, rewrite_metadata

W = torch.arange(64, dtype=torch.float32).reshape(8, 8)
#: the model record a GPT of 2 layers, hidden 64, 4 heads would carry (the CLI checks a layout against it)
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 96,
         "make_vocab_size_divisible_by": 16}


def _save(save: str, it: int, framework: str = "megatron-core", model: dict | None = None) -> str:
    chunk = LocalChunk(TensorMeta("w", (8, 8), "float32"), Chunk("w", (0, 0), (8, 8)), W.reshape(-1).clone(), True)
    path = save_chunks([chunk], save, it, {"tp": 1, "pp": 1, "dp": 1}, {}, lambda infos: {}).path
    rewrite_metadata(path, lambda m: m.update(framework=framework, model=model or MODEL,
                                              use_distributed_optimizer=True))
    return path


def _megatron_iteration(save: str, it: int) -> str:
    """An iteration directory as megatron-core's dist_checkpointing leaves it (its metadata.json), tracker updated."""
    path = os.path.join(save, f"iter_{it:07d}")
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(save, TRACKER_FILE), "w") as f:
        f.write(str(it))
    return path


def _export(capsys, *args: str) -> tuple[int, str]:
    rc = cli.main(["export-megatron", *args])
    return rc, capsys.readouterr().err


def test_a_layout_that_does_not_divide_the_model_is_refused_with_plans_reasons(tmp_path, capsys) -> None:
    ckpt, out = _save(str(tmp_path / "save"), 3), str(tmp_path / "out")
    rc, err = _export(capsys, ckpt, out, "--to", "tp=3,pp=4,dp=1")
    assert rc == 2, err
    assert "--to tp=3,pp=4,dp=1" in err and "TP=3 does not divide the number of attention heads (4)" in err, err
    assert "PP=4 does not divide the number of layers (2)" in err, err
    rc, err = _export(capsys, ckpt, out, "--to", "tp=2,pp=1,dp=x")
    assert rc == 2 and "--to tp=2,pp=1,dp=x" in err, err
    assert not os.path.exists(out)


def test_the_checks_run_without_torch(tmp_path) -> None:
    """Everything export-megatron checks, it checks before torch is imported (the processes import it)."""
    ckpt, out = _save(str(tmp_path / "save"), 3), str(tmp_path / "out")
    code = "import sys; sys.modules['torch'] = None\nfrom tenplex_megatron.cli import main\nsys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "export-megatron", ckpt, out, "--to", "tp=3"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert p.returncode == 2 and "TP=3 does not divide the number of attention heads (4)" in p.stderr, p.stderr
    assert not os.path.exists(out)


def test_an_out_that_exists_and_is_not_empty_is_refused_and_left_alone(tmp_path, capsys) -> None:
    ckpt = _save(str(tmp_path / "save"), 3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _export(capsys, ckpt, str(out), "--to", "tp=1,pp=1,dp=1")
    assert rc == 2 and f"{out}: not empty" in err, err
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, err = _export(capsys, ckpt, str(afile), "--to", "tp=1,pp=1,dp=1")
    assert rc == 2 and f"{afile}: exists and is not a directory" in err, err


def test_what_is_not_a_megatron_core_tenplex_checkpoint_is_refused(tmp_path, capsys) -> None:
    out = str(tmp_path / "out")
    rc, err = _export(capsys, str(tmp_path), out, "--to", "tp=1")
    assert rc == 2 and "no complete tenplex checkpoint here" in err, err
    ds = _save(str(tmp_path / "ds"), 2, framework="deepspeed")
    rc, err = _export(capsys, ds, out, "--to", "tp=1")
    assert rc == 2 and "'deepspeed'" in err and "export-megatron reads megatron-core checkpoints" in err, err
    assert not os.path.exists(out)


def test_a_load_without_tenplex_meeting_a_tenplex_checkpoint_is_refused_naming_export_megatron(tmp_path) -> None:
    save = str(tmp_path / "save")
    it3 = _save(save, 3)
    for load in (save, it3):  # the save directory (its tracker names iteration 3) or the iteration directory itself
        with pytest.raises(restart_sources.TenplexCheckpointWithoutFlag) as e:
            restart_sources.find_sources(None, load, tenplex=False)
        msg = str(e.value)
        assert f"{it3} is a tenplex checkpoint" in msg and f"tenplex-megatron export-megatron {it3} OUT" in msg, msg
        assert "run with --tenplex" in msg
    # with --tenplex the same directory loads
    assert restart_sources.find_sources(None, save, tenplex=True).tenplex == it3
    # Megatron's own checkpoint, newer and named by the tracker: that one loads without --tenplex
    it6 = _megatron_iteration(save, 6)
    assert restart_sources.find_sources(None, save, tenplex=False).megatron == it6
    # the tracker names the tenplex iteration again (a later tenplex save): refused
    with open(os.path.join(save, TRACKER_FILE), "w") as f:
        f.write("3")
    with pytest.raises(restart_sources.TenplexCheckpointWithoutFlag):
        restart_sources.find_sources(None, save, tenplex=False)
    # nothing there, or no --load: a fresh start as before
    assert restart_sources.find_sources(None, str(tmp_path / "empty"), tenplex=False).megatron is None
    assert restart_sources.find_sources(None, None, tenplex=False).megatron is None
