"""The host-memory flags of the reference trainer and of the Megatron-LM hook: parsed, and bad values refused
naming the flag. In-process (the hook's checks run before Megatron-LM's own; Megatron-LM is not needed)."""

from __future__ import annotations

import pytest

from tenplex_megatron.training.pretrain import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
        "--vocab-size", "128"]
MEMORY = ["--tenplex", "--save", "ckpt", "--tenplex-memory", "/dev/shm/job"]


def test_replication_rate_is_parsed_and_unlimited_by_default() -> None:
    assert parse_args([*BASE, *MEMORY]).tenplex_replication_rate == 0.0
    assert parse_args([*BASE, *MEMORY, "--tenplex-replication-rate", "25"]).tenplex_replication_rate == 25.0
    assert parse_args([*BASE, *MEMORY, "--tenplex-replication-rate", "auto"]).tenplex_replication_rate == "auto"


def test_replication_rate_becomes_the_tiers_cap_or_its_pace() -> None:
    from tenplex_megatron.memory.settings import AUTO_PACE, MemorySettings

    capped = MemorySettings("/dev/shm/job", "job", None, replication_rate=25.0)
    assert (capped.rate_cap, capped.pace) == (25.0, 0.0)
    auto = MemorySettings("/dev/shm/job", "job", None, replication_rate="auto")
    assert (auto.rate_cap, auto.pace) == (0.0, AUTO_PACE)
    for bad in ("fast", -1.0, float("nan")):  # DeepSpeed's open_memory(replication_rate=...) has no parser first
        with pytest.raises(ValueError, match="--tenplex-replication-rate"):
            MemorySettings("/dev/shm/job", "job", None, replication_rate=bad)
    with pytest.raises(ValueError, match="--tenplex-replicas must be >= 1, got 0"):
        MemorySettings("/dev/shm/job", "job", None, replicas=0)


@pytest.mark.parametrize("flags, message", [
    (["--tenplex-replication-rate", "-1"], "--tenplex-replication-rate must be >= 0 (MB/s; 0: unlimited), got -1.0"),
    (["--tenplex-replication-rate", "fast"], "--tenplex-replication-rate: expected MB/s or auto, got 'fast'"),
    (["--tenplex-replicas", "0"], "--tenplex-replicas must be >= 1, got 0"),
    (["--tenplex-persist-interval", "0"], "--tenplex-persist-interval must be >= 1, got 0"),
    (["--tenplex-memory-limit", "0"], "--tenplex-memory-limit must be > 0 (GB), got 0.0"),
])
def test_bad_memory_flags_are_named(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, *MEMORY, *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--tenplex-memory", "/dev/shm/job"], "--tenplex-memory needs --tenplex"),
    (["--tenplex", "--tenplex-memory", "/dev/shm/job", "--tenplex-memory-keep", "0"],
     "--tenplex-memory-keep must be >= 1, got 0"),
])
def test_megatron_lm_hook_takes_the_same_flags_and_refuses_bad_ones(flags: list[str], message: str,
                                                                      capsys: pytest.CaptureFixture) -> None:
    import argparse

    from tenplex_megatron.frontdoor import megatron_lm

    parser = megatron_lm.add_tenplex_args(argparse.ArgumentParser())
    good = parser.parse_args(["--tenplex", "--tenplex-memory", "--tenplex-replication-rate", "25"])
    assert good.tenplex_memory and good.tenplex_replication_rate == 25.0 and good.tenplex_replicas == 2
    with pytest.raises(SystemExit) as e:
        megatron_lm._validate_args(parser.parse_args(flags))  # refused before Megatron-LM's own validate_args
    assert e.value.code == 2 and message in capsys.readouterr().err
