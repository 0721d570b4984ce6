"""Megatron features tenplex does not re-shard yet: found in a job's flags or a checkpoint's saved args, refused
before any process group starts or any state is touched, naming the flag (or the file and field) and why. Pure."""

from __future__ import annotations

from typing import Any

from tenplex_megatron.errors import TenplexError


class UnsupportedFeatureError(TenplexError, ValueError):
    """A checkpoint whose saved args turn on a feature tenplex cannot re-shard; the message names file and field."""


#: (args attribute, value that means "off", flag, why it is refused)
UNSUPPORTED: tuple[tuple[str, Any, str, str], ...] = (
    ("context_parallel_size", 1, "--context-parallel-size",
     "context parallelism is not re-sharded yet (the distributed optimizer's shards span DP x CP)"),
    ("use_megatron_fsdp", False, "--use-megatron-fsdp",
     "Megatron FSDP shards parameters in its own buffers, which tenplex does not describe"),
    ("use_torch_fsdp2", False, "--use-torch-fsdp2",
     "torch FSDP2 shards parameters as DTensors, which tenplex does not describe"),
)


def unsupported_flags(args: Any) -> list[str]:
    """One line per unsupported feature that ``args`` (Megatron-LM's parsed flags, or saved args) turns on."""
    return _turned_on(args, UNSUPPORTED)


#: Flags refused in Megatron's own checkpoints' saved args only (a running job with them is re-sharded).
SAVED_ONLY: tuple[tuple[str, Any, str, str], ...] = (
    ("moe_grouped_gemm", False, "--moe-grouped-gemm",
     "Megatron's own checkpoint of grouped-GEMM experts is not adopted yet (GroupedMLP's weights are stored there "
     "transposed, under SequentialMLP's keys); tenplex's own checkpoints of GroupedMLP experts re-shard"),
)


def _turned_on(args: Any, table: tuple[tuple[str, Any, str, str], ...]) -> list[str]:
    out = []
    for attr, off, flag, why in table:
        value = args.get(attr, off) if isinstance(args, dict) else getattr(args, attr, off)
        if value is None or value is False or value == off:
            continue
        out.append(f"{flag}{'' if value is True else f' {value}'}: {why}")
    return out


def check_saved_args(path: str, args: Any) -> None:
    """Refuse a checkpoint whose saved args turn on a feature tenplex cannot re-shard, naming the file and field."""
    problems = [*unsupported_flags(args), *_turned_on(args, SAVED_ONLY)] if args is not None else []
    if problems:
        raise UnsupportedFeatureError(f"{path}: saved args: " + "; ".join(problems))


#: Flags refused in a running job's own args only (a checkpoint Megatron saved with them is adopted as usual).
JOB_ONLY: tuple[tuple[str, Any, str, str], ...] = ()


def unsupported_job_flags(args: Any) -> list[str]:
    """One line per flag of a running job (Megatron-LM's parsed flags) that tenplex refuses there, beyond
    :func:`unsupported_flags`."""
    out = []
    for attr, off, flag, why in JOB_ONLY:
        value = args.get(attr, off) if isinstance(args, dict) else getattr(args, attr, off)
        if value is not None and value is not False and value != off:
            out.append(f"{flag}: {why}")
    if _get(args, "moe_grouped_gemm", False) and _get(args, "transformer_impl", "local") == "transformer_engine" \
            and not _get(args, "moe_use_legacy_grouped_gemm", False):
        out.append("--moe-grouped-gemm with --transformer-impl transformer_engine: Transformer Engine's grouped experts "
                   "(TEGroupedMLP) have not been run with tenplex yet; add --moe-use-legacy-grouped-gemm (megatron-core's "
                   "GroupedMLP, which tenplex re-shards) or leave out --moe-grouped-gemm (SequentialMLP)")
    return out


def missing_transformer_engine(args: Any, have_te: bool) -> str | None:
    """``--transformer-impl transformer_engine`` (Megatron-LM's default) where Transformer Engine cannot be imported
    (``have_te``, megatron-core's own ``HAVE_TE``): Megatron-LM's GPT layer spec needs it and would stop while it
    builds the model, after the process groups, with a NameError or TypeError on ``TESpecProvider``. None where
    ``--spec`` or the legacy model chooses the layers instead."""
    if have_te or _get(args, "transformer_impl", "local") != "transformer_engine" or _get(args, "spec", None) \
            or _get(args, "use_legacy_models", False):
        return None
    return ("--transformer-impl transformer_engine (Megatron-LM's default): Transformer Engine cannot be imported "
            "(megatron-core's HAVE_TE is False), and Megatron-LM's GPT layer spec needs it to build the model; "
            "install Transformer Engine, or pass --transformer-impl local (megatron-core's own layers, which tenplex "
            "re-shards alike)")


def _get(args: Any, attr: str, default: Any) -> Any:
    return args.get(attr, default) if isinstance(args, dict) else getattr(args, attr, default)
