"""Megatron features refused with --tenplex (plan/unsupported.py): named with the flag and why, from live flags or
from a checkpoint's saved args (then naming the file and field), before anything is built or touched."""

from __future__ import annotations

import argparse

import pytest

from tenplex_megatron.plan.unsupported import check_saved_args, unsupported_flags


def _args(**kw: object) -> argparse.Namespace:
    base = {"context_parallel_size": 1, "use_megatron_fsdp": False, "use_torch_fsdp2": False, "num_experts": None,
            "expert_model_parallel_size": 1, "moe_grouped_gemm": False}
    return argparse.Namespace(**{**base, **kw})


def test_defaults_pass() -> None:
    assert unsupported_flags(_args()) == []
    assert unsupported_flags(argparse.Namespace()) == []  # older Megatron-LM args lack the attributes
    check_saved_args("ckpt/common.pt", None)


@pytest.mark.parametrize("kw,needle", [
    ({"context_parallel_size": 2}, "--context-parallel-size 2: context parallelism is not re-sharded yet"),
    ({"use_megatron_fsdp": True}, "--use-megatron-fsdp: Megatron FSDP"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2: torch FSDP2"),
])
def test_each_feature_named(kw: dict, needle: str) -> None:
    (line,) = unsupported_flags(_args(**kw))
    assert line.startswith(needle)
    assert unsupported_flags(dict(vars(_args(**kw)))) == [line]  # saved args may be a dict


def test_moe_with_sequential_experts_passes() -> None:
    """Mixture of experts and expert parallelism are re-sharded (SequentialMLP's experts): not refused."""
    assert unsupported_flags(_args(num_experts=8, expert_model_parallel_size=4)) == []


def test_grouped_gemm_experts() -> None:
    """megatron-core's GroupedMLP (--moe-grouped-gemm with the local spec, or with --moe-use-legacy-grouped-gemm) is
    re-sharded; Transformer Engine's TEGroupedMLP (the flag with --transformer-impl transformer_engine) has not run
    with tenplex and is refused in a job naming both flags; Megatron's own checkpoint saved with the flag is refused
    naming the file, since its adoption is not described yet."""
    from tenplex_megatron.plan.unsupported import unsupported_job_flags

    local = _args(num_experts=8, moe_grouped_gemm=True, transformer_impl="local")
    assert unsupported_flags(local) == [] and unsupported_job_flags(local) == []
    legacy = _args(num_experts=8, moe_grouped_gemm=True, transformer_impl="transformer_engine",
                   moe_use_legacy_grouped_gemm=True)
    assert unsupported_job_flags(legacy) == []
    (problem,) = unsupported_job_flags(_args(num_experts=8, moe_grouped_gemm=True,
                                             transformer_impl="transformer_engine"))
    assert problem.startswith("--moe-grouped-gemm with --transformer-impl transformer_engine: Transformer Engine's "
                              "grouped experts (TEGroupedMLP) have not been run with tenplex yet")
    assert "--moe-use-legacy-grouped-gemm" in problem
    assert unsupported_job_flags({"moe_grouped_gemm": True, "transformer_impl": "transformer_engine"}) == [problem]
    with pytest.raises(ValueError, match=r"^ckpt/common.pt: saved args: --moe-grouped-gemm: Megatron's own checkpoint "
                                         r"of grouped-GEMM experts is not adopted yet"):
        check_saved_args("ckpt/common.pt", {"moe_grouped_gemm": True})


def test_saved_args_name_the_file() -> None:
    with pytest.raises(ValueError, match=r"^ckpt/iter_0000004/common.pt: saved args: --context-parallel-size 2: .*; "
                                         r"--use-torch-fsdp2: "):
        check_saved_args("ckpt/iter_0000004/common.pt", _args(context_parallel_size=2, use_torch_fsdp2=True))


def test_async_save_is_honoured_through_the_host_memory_tier(tmp_path) -> None:
    """Megatron-LM's --async-save with --tenplex is not refused: the job's tier holds each save in /dev/shm (or
    --tenplex-memory's directory) and persists every one in the background (the save and restart:
    tests/multiproc/test_async_save.py); without --tenplex it is Megatron's own; a checkpoint saved with it is
    adopted as usual."""
    from argparse import Namespace

    from tenplex_megatron.frontdoor.job_config import JobConfig
    from tenplex_megatron.frontdoor.memory_flags import async_save_dir
    from tenplex_megatron.plan.unsupported import check_saved_args, unsupported_job_flags
    from tenplex_megatron.training.pretrain import parse_args

    assert unsupported_job_flags(Namespace(async_save=True, tenplex=True)) == []
    check_saved_args("ckpt/iter_0000003/common.pt", {"async_save": True})
    save = str(tmp_path / "ckpt")
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "96", "--save", save,
            "--async-save"]
    config = JobConfig.from_args(parse_args([*tiny, "--tenplex"]), "pretrain_gpt.py")
    assert config.async_save and config.memory is not None and config.memory.mem == async_save_dir(save)
    assert config.leases.memory == async_save_dir(save) and config.memory.save_dir == save
    mem = str(tmp_path / "mem")
    config = JobConfig.from_args(parse_args([*tiny, "--tenplex", "--tenplex-memory", mem]), "pretrain_gpt.py")
    assert config.async_save and config.memory.mem == mem
    config = JobConfig.from_args(parse_args(tiny), "pretrain_gpt.py")
    assert not config.async_save and config.memory is None and config.leases.memory is None


def test_transformer_engine_spec_without_transformer_engine() -> None:
    """--transformer-impl transformer_engine (Megatron-LM's default) where Transformer Engine cannot be imported is
    refused naming the flag and both ways on; with it importable, with the local spec, a --spec or the legacy model,
    nothing is said."""
    from tenplex_megatron.plan.unsupported import missing_transformer_engine

    te = _args(transformer_impl="transformer_engine")
    problem = missing_transformer_engine(te, have_te=False)
    assert problem is not None and problem.startswith("--transformer-impl transformer_engine (Megatron-LM's default): "
                                                      "Transformer Engine cannot be imported")
    assert "install Transformer Engine, or pass --transformer-impl local" in problem
    assert missing_transformer_engine(te, have_te=True) is None
    assert missing_transformer_engine(_args(transformer_impl="local"), have_te=False) is None
    assert missing_transformer_engine(_args(transformer_impl="transformer_engine", spec=["my.module", "spec"]),
                                      have_te=False) is None
    assert missing_transformer_engine(_args(transformer_impl="transformer_engine", use_legacy_models=True),
                                      have_te=False) is None
