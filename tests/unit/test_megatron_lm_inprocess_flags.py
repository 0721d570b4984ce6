"""Megatron-LM's ``--inprocess-restart`` with ``--tenplex``: the refusals before any process group (a launcher that
does not serve the stores, no ``--load``, NVRx missing, a timeout too short; each naming the flag) and the legal
world sizes of a fixed layout."""

from __future__ import annotations

import argparse
import sys

import pytest

from tenplex_megatron.frontdoor import inprocess
from tenplex_megatron.frontdoor import megatron_lm_inprocess as mlm

ARGV = ["--tensor-model-parallel-size", "2", "--tenplex", "--inprocess-restart", "--load", "/ckpt"]


def _args(**kw: object) -> argparse.Namespace:
    base = {"load": "/ckpt", "save": "/ckpt", "save_interval": 1, "tenplex_inprocess_timeout": 10.0,
            "tenplex_memory": "/dev/shm/x", "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None,
            "micro_batch_size": 2, "global_batch_size": 8}
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def rank0_of_4(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(inprocess.STORE_ENV, raising=False)


def test_wanted_only_with_both_flags() -> None:
    assert mlm.wanted(ARGV)
    assert not mlm.wanted(["--inprocess-restart"]) and not mlm.wanted(["--tenplex"])


def test_plain_torchrun_is_refused_naming_the_flag_and_the_command(rank0_of_4: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    with pytest.raises(SystemExit) as e:
        mlm.start(_args(), ARGV)
    msg = str(e.value)
    assert "--inprocess-restart with --tenplex needs the survivors" in msg
    assert f"python -m tenplex_megatron.frontdoor.launch --nproc-per-node 4 pretrain_gpt.py {' '.join(ARGV)}" in msg


def test_no_load_is_refused(rank0_of_4: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.STORE_ENV, "127.0.0.1:1")
    with pytest.raises(SystemExit, match="--inprocess-restart with --tenplex needs --load"):
        mlm.start(_args(load=None), ARGV)


def test_nvrx_missing_names_the_extra(rank0_of_4: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.STORE_ENV, "127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.inprocess", None)
    with pytest.raises(SystemExit, match=r"pip install 'tenplex-megatron\[inprocess\]'"):
        mlm.start(_args(), ARGV)


def test_a_timeout_too_short_is_named(rank0_of_4: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.STORE_ENV, "127.0.0.1:1")
    with pytest.raises(SystemExit, match=r"--tenplex-inprocess-timeout must be > 1 seconds .*got 0.5"):
        mlm.start(_args(tenplex_inprocess_timeout=0.5), ARGV)


def test_fixed_layout_admits_the_world_sizes_it_divides() -> None:
    args = _args()
    reasons = {n: mlm.fixed_layout_reason(args, n) for n in range(1, 9)}
    assert [n for n, r in reasons.items() if not r] == [2, 4, 8]
    assert "2 x 1 x 1 does not divide it" in reasons[3]
    assert "--global-batch-size 8 is not a multiple of --micro-batch-size x DP = 2 x 3" in \
        mlm.fixed_layout_reason(args, 6)
    assert inprocess.admitted(3, lambda n: not mlm.fixed_layout_reason(args, n)) == 2
