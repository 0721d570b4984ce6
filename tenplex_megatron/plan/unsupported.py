"""Megatron features tenplex does not re-shard yet: found in a job's flags or a checkpoint's saved args, refused
before any process group starts or any state is touched, naming the flag (or the file and field) and why. Pure."""

from __future__ import annotations

from typing import Any

#: (args attribute, value that means "off", flag, why it is refused)
UNSUPPORTED: tuple[tuple[str, Any, str, str], ...] = (
    ("context_parallel_size", 1, "--context-parallel-size",
     "context parallelism is not re-sharded yet (the distributed optimizer's shards span DP x CP)"),
    ("use_megatron_fsdp", False, "--use-megatron-fsdp",
     "Megatron FSDP shards parameters in its own buffers, which tenplex does not describe"),
    ("use_torch_fsdp2", False, "--use-torch-fsdp2",
     "torch FSDP2 shards parameters as DTensors, which tenplex does not describe"),
    ("moe_grouped_gemm", False, "--moe-grouped-gemm",
     "the grouped-GEMM experts (GroupedMLP, TEGroupedMLP) are not described yet: give SequentialMLP's experts"),
)


def unsupported_flags(args: Any) -> list[str]:
    """One line per unsupported feature that ``args`` (Megatron-LM's parsed flags, or saved args) turns on."""
    out = []
    for attr, off, flag, why in UNSUPPORTED:
        value = args.get(attr, off) if isinstance(args, dict) else getattr(args, attr, off)
        if value is None or value is False or value == off:
            continue
        out.append(f"{flag}{'' if value is True else f' {value}'}: {why}")
    return out


def check_saved_args(path: str, args: Any) -> None:
    """Refuse a checkpoint whose saved args turn on a feature tenplex cannot re-shard, naming the file and field."""
    problems = unsupported_flags(args) if args is not None else []
    if problems:
        raise ValueError(f"{path}: saved args: " + "; ".join(problems))
