"""How every Megatron-LM checkpoint setting behaves under ``--tenplex``: honoured, refused at start, or of no effect.

One row per field of Megatron-LM's checkpoint settings on core_v0.15-0.19 (``CheckpointConfig`` and the
checkpointing argument group), plus ``--dataloader-type``. ``tests/megatron_lm`` reads a checkout's settings and
fails when one has no row, so a new release line cannot slip a setting past the hook. The helpers turn parsed
flags into what the engine and storage take (:class:`LoadScope`, :class:`SaveScope`, :class:`Retention`). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

HONOURED = "honoured"
REFUSED = "refused"
NO_EFFECT = "no effect"
VERDICTS = (HONOURED, REFUSED, NO_EFFECT)


@dataclass(frozen=True)
class Setting:
    """One Megatron-LM checkpoint setting: the args attributes it sets, its flag, the verdict and why.

    ``accepted``: the values a job under ``--tenplex`` may start with (None: any); another is refused at start."""

    names: tuple[str, ...]
    flag: str
    verdict: str
    why: str
    accepted: tuple[Any, ...] | None = None


_ASYNC = "a setting of Megatron's own async writer; with --tenplex the host-memory tier writes in the background"
_NON_PERSISTENT = "only with --non-persistent-ckpt-type, which --tenplex refuses"
_TORCH_DIST = "a setting of megatron-core's torch_dist save or load, which --tenplex replaces"

SETTINGS: tuple[Setting, ...] = (
    Setting(("save",), "--save", HONOURED, "the directory tenplex checkpoints are written to"),
    Setting(("save_interval",), "--save-interval", HONOURED, "Megatron-LM's loop decides when to save"),
    Setting(("save_retain_interval",), "--save-retain-interval", HONOURED,
            "tenplex's retention keeps every checkpoint whose iteration is a multiple of it, besides the newest "
            "(and the newest --tenplex-keep / --most-recent-k)"),
    Setting(("most_recent_k",), "--most-recent-k", HONOURED,
            "tenplex's retention keeps the newest K checkpoints (-1: all); with --tenplex-keep the smaller of the "
            "two (a CheckpointConfig field without a command-line flag in Megatron-LM core_v0.15-0.19)"),
    Setting(("save_optim", "no_save_optim"), "--no-save-optim", HONOURED,
            "a weights-only tenplex checkpoint, marked so in metadata.json: a load from it needs --no-load-optim "
            "or --finetune; with --tenplex-memory or --async-save the snapshot and its durable copy alike "
            "(tests/megatron_lm/test_megatron_lm_user_flags.py -k no_save_optim)"),
    Setting(("save_rng", "no_save_rng"), "--no-save-rng", HONOURED,
            "the checkpoint holds no RNG state: a load from it re-seeds from (seed, iteration); with "
            "--tenplex-memory or --async-save the snapshot and its durable copy alike"),
    Setting(("load",), "--load", HONOURED, "the newest complete tenplex checkpoint there, re-sharded"),
    Setting(("load_optim", "no_load_optim"), "--no-load-optim", HONOURED,
            "the weights alone are loaded (at any layout): fresh optimizer and LR schedule, main weights from the "
            "loaded weights"),
    Setting(("load_rng", "no_load_rng"), "--no-load-rng", HONOURED, "the saved RNG state is left alone"),
    Setting(("load_main_params_from_ckpt",), "--load-main-params-from-ckpt", REFUSED,
            "with --no-load-optim tenplex takes the main weights from the loaded model weights; taking them from "
            "the checkpoint's fp32 copies is not implemented", (None, False)),
    Setting(("non_persistent_ckpt_type",), "--non-persistent-ckpt-type", REFUSED,
            "Megatron's non-persistent checkpoints (global, local, in_memory) are written in its own format beside "
            "tenplex's and would not be re-sharded, nor compared with tenplex's on restart; use --tenplex-memory "
            "(snapshots into host memory, persisted in the background)", (None,)),
    Setting(("non_persistent_save_interval",), "--non-persistent-save-interval", REFUSED,
            "Megatron's non-persistent checkpoints are refused with --tenplex; use --tenplex-memory", (None,)),
    Setting(("non_persistent_global_ckpt_dir",), "--non-persistent-global-ckpt-dir", NO_EFFECT, _NON_PERSISTENT),
    Setting(("non_persistent_local_ckpt_dir",), "--non-persistent-local-ckpt-dir", NO_EFFECT, _NON_PERSISTENT),
    Setting(("non_persistent_local_ckpt_algo",), "--non-persistent-local-ckpt-algo", NO_EFFECT, _NON_PERSISTENT),
    Setting(("replication",), "--replication", NO_EFFECT, _NON_PERSISTENT + " (local checkpoints' replicas)"),
    Setting(("replication_jump",), "--replication-jump", NO_EFFECT, _NON_PERSISTENT),
    Setting(("replication_factor",), "--replication-factor", NO_EFFECT, _NON_PERSISTENT),
    Setting(("finetune",), "--finetune", HONOURED,
            "the weights alone, at any layout: iteration 0, fresh optimizer, LR schedule and data position, RNG "
            "left alone"),
    Setting(("pretrained_checkpoint",), "--pretrained-checkpoint", HONOURED,
            "when --load holds no checkpoint, the one there is loaded as with --finetune"),
    Setting(("ckpt_step",), "--ckpt-step", HONOURED,
            "that iteration's tenplex checkpoint is loaded at the new layout; a step not there is refused, "
            "listing the steps there"),
    Setting(("perform_initialization",), "--no-initialization", HONOURED,
            "Megatron-LM builds the model without initialising it; the load fills it"),
    Setting(("use_checkpoint_args",), "--use-checkpoint-args", HONOURED,
            "the model flags Megatron-LM's load_args_from_checkpoint copies come from the tenplex checkpoint's "
            "metadata.json (plan/checkpoint_args.py), the layout from the command line; a flag given that the "
            "checkpoint contradicts stops the job at start, naming both values (tests/megatron_lm/"
            "test_megatron_lm_user_flags.py -k use_checkpoint_args: TP2 -> TP1 x DP2, the model flags left out)"),
    Setting(("use_mp_args_from_checkpoint_args",), "--use-mp-args-from-checkpoint-args", REFUSED,
            "tenplex re-shards to the job's own layout: the saved one is not copied", (None, False)),
    Setting(("use_tokenizer_model_from_checkpoint_args",), "--no-use-tokenizer-model-from-checkpoint-args",
            HONOURED, "with --use-checkpoint-args: the tokenizer type and model from the checkpoint's record, or not"),
    Setting(("exit_on_missing_checkpoint",), "--exit-on-missing-checkpoint", HONOURED,
            "no checkpoint (tenplex's, Megatron's or a host-memory snapshot) under --load: Megatron-LM exits"),
    Setting(("ckpt_format",), "--ckpt-format", NO_EFFECT,
            "saves are tenplex checkpoints whatever it says; Megatron's own checkpoint under --load (torch_dist or "
            "torch) is recognised from its files and adopted"),
    Setting(("auto_detect_ckpt_format",), "--auto-detect-ckpt-format", NO_EFFECT,
            "tenplex recognises the format of what is under --load from its files"),
    Setting(("ckpt_convert_format",), "--ckpt-convert-format", REFUSED,
            "Megatron-LM's conversion saves through save_checkpoint, which --tenplex turns into a tenplex save: "
            "convert without --tenplex", (None,)),
    Setting(("ckpt_convert_save",), "--ckpt-convert-save", NO_EFFECT,
            "only with --ckpt-convert-format, which --tenplex refuses"),
    Setting(("ckpt_convert_update_legacy_dist_opt_format",), "--ckpt-convert-update-legacy-dist-opt-format", REFUSED,
            "tenplex adopts the distributed optimizer's current formats only: update the checkpoint with "
            "Megatron-LM first, without --tenplex", (None, False)),
    Setting(("ckpt_fully_parallel_save",), "--no-ckpt-fully-parallel-save", NO_EFFECT,
            "a tenplex save is always fully parallel (each rank writes its share) and always re-shardable"),
    Setting(("ckpt_fully_parallel_save_deprecated",), "--ckpt-fully-parallel-save", NO_EFFECT,
            "deprecated by Megatron-LM; a tenplex save is always fully parallel"),
    Setting(("ckpt_fully_parallel_load",), "--ckpt-fully-parallel-load", NO_EFFECT,
            "a tenplex load is always parallel: each rank reads only the bytes it needs"),
    Setting(("ckpt_fully_parallel_load_exchange_algo",), "--ckpt-fully-parallel-load-exchange-algo", NO_EFFECT,
            _TORCH_DIST),
    Setting(("ckpt_fully_parallel_save_process_group",), "--ckpt-fully-parallel-save-process-group", NO_EFFECT,
            _TORCH_DIST),
    Setting(("ckpt_fully_parallel_load_process_group",), "--ckpt-fully-parallel-load-process-group", NO_EFFECT,
            _TORCH_DIST),
    Setting(("async_save",), "--async-save", HONOURED,
            "the save returns once the state is captured in host memory (--tenplex-memory's tier, by default in "
            "/dev/shm); a helper process writes it to --save in the background, committed before the next save "
            "and at exit (tests/megatron_lm/test_megatron_lm.py -k async_save: TP2 -> TP1 x DP2, losses equal to "
            "stock Megatron-LM's own --async-save run; tests/multiproc/test_async_save.py -m slow -k kill: the "
            "whole job SIGKILLed during a persist keeps the previous checkpoint committed)"),
    Setting(("use_persistent_ckpt_worker",), "--use-persistent-ckpt-worker", NO_EFFECT, _ASYNC),
    Setting(("async_strategy",), "--async-strategy", NO_EFFECT, _ASYNC),
    Setting(("async_ckpt_cpu_priority",), "--async-ckpt-cpu-priority", NO_EFFECT, _ASYNC),
    Setting(("async_ckpt_io_priority",), "--async-ckpt-io-priority", NO_EFFECT, _ASYNC),
    Setting(("async_ckpt_use_cpu_shm",), "--async-ckpt-use-cpu-shm", NO_EFFECT, _ASYNC),
    Setting(("dist_ckpt_workers",), "--dist-ckpt-workers", NO_EFFECT, _ASYNC),
    Setting(("ckpt_assume_constant_structure",), "--ckpt-assume-constant-structure", NO_EFFECT, _TORCH_DIST),
    Setting(("ckpt_load_validate_sharding_integrity",), "--no-ckpt-load-validate-sharding-integrity", NO_EFFECT,
            "tenplex's planner always proves that every element is loaded exactly once"),
    Setting(("strict_fsdp_dtensor_load",), "--no-strict-fsdp-dtensor-load", NO_EFFECT,
            "the fsdp_dtensor format only (Megatron FSDP, which --tenplex refuses)"),
    Setting(("dist_ckpt_strictness",), "--dist-ckpt-strictness", NO_EFFECT,
            "a tenplex load always refuses a checkpoint whose tensors no rank of the job holds"),
    Setting(("dist_ckpt_save_pre_mcore_014",), "--dist-ckpt-save-pre-mcore-014", NO_EFFECT, _TORCH_DIST),
    Setting(("dist_ckpt_optim_fully_reshardable",), "--dist-ckpt-optim-fully-reshardable", NO_EFFECT,
            "tenplex's checkpoints re-shard along every dimension whatever it says"),
    Setting(("distrib_optim_fully_reshardable_mem_efficient",), "--distrib-optim-fully-reshardable-mem-efficient",
            NO_EFFECT, _TORCH_DIST),
    Setting(("save_tokenizer_assets",), "--save-tokenizer-assets", NO_EFFECT,
            "a tenplex checkpoint holds no tokenizer files"),
    Setting(("verify_integrity",), "--verify-integrity", NO_EFFECT,
            "a tenplex load always checks the CRC-32 of every block it reads (off: --tenplex-no-verify)"),
    Setting(("stream_ckpt_dequant",), "--no-stream-ckpt-dequant", NO_EFFECT,
            "quantized parameters in a torch_dist load, which --tenplex replaces"),
    Setting(("override_ckpt_iteration",), "--override-ckpt-iteration", REFUSED,
            "not implemented for tenplex checkpoints: --ckpt-step loads an earlier iteration with its own data "
            "position", (None,)),
    Setting(("use_dist_ckpt_deprecated",), "--use-dist-ckpt", NO_EFFECT, "deprecated by Megatron-LM (--ckpt-format)"),
    Setting(("dist_ckpt_format_deprecated",), "--dist-ckpt-format", NO_EFFECT,
            "deprecated by Megatron-LM (--ckpt-format)"),
    Setting(("save_wgrads_interval",), "--save-wgrads-interval", HONOURED,
            "Megatron-LM's own dumps of gradients, not checkpoints: unchanged"),
    Setting(("save_dgrads_interval",), "--save-dgrads-interval", HONOURED,
            "Megatron-LM's own dumps of gradients, not checkpoints: unchanged"),
    Setting(("save_params_interval",), "--save-params-interval", HONOURED,
            "Megatron-LM's own dumps of parameters, not checkpoints: unchanged"),
    Setting(("save_activations_interval",), "--save-activations-interval", HONOURED,
            "Megatron-LM's own dumps of activations, not checkpoints: unchanged"),
    Setting(("save_tokens_per_expert_interval",), "--save-tokens-per-expert-interval", HONOURED,
            "Megatron-LM's own dumps of routing counts, not checkpoints: unchanged"),
    Setting(("dataloader_type",), "--dataloader-type", HONOURED,
            "single: tenplex's sampler, the same samples in each global batch in any DP size; external: the "
            "dataset is its own loader, passed through (its position is the user's); cyclic is refused: "
            "Megatron's random sampler buckets the samples by DP rank, so a restart at another DP size would "
            "train on other samples", (None, "single", "external")),
)

BY_NAME: Mapping[str, Setting] = MappingProxyType({name: s for s in SETTINGS for name in s.names})


def accepts(value: Any, accepted: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``accepted``: the same type and value (``True`` is not ``1``)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in accepted)


def refusals(args: Any) -> list[str]:
    """One line per setting in ``args`` (Megatron-LM's parsed flags) that ``--tenplex`` refuses, naming the flag."""
    out = []
    for s in SETTINGS:
        if s.accepted is None:
            continue
        for name in s.names:
            value = getattr(args, name, s.accepted[0])
            if not accepts(value, s.accepted):
                shown = "" if value is True else f" {value}"
                out.append(f"{s.flag}{shown}: {s.why if s.verdict == REFUSED else 'refused here: ' + s.why}")
                break
    return out


def unclassified(names: set[str] | list[str]) -> list[str]:
    """The settings among ``names`` (args attributes) that the table does not classify."""
    return sorted(set(names) - set(BY_NAME))


@dataclass(frozen=True)
class LoadScope:
    """What a load takes back: which iteration (None: the newest), the optimizer and LR schedule, the RNG state; a
    fine-tune also starts at iteration 0 with a fresh data position."""

    iteration: int | None = None
    optimizer: bool = True
    rng: bool = True
    finetune: bool = False


@dataclass(frozen=True)
class SaveScope:
    """What a save writes besides the weights: the optimizer (with the LR schedule) and the RNG state."""

    optimizer: bool = True
    rng: bool = True


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints stay after a save: the newest ``keep`` (None: all; with only ``retain_interval``
    given, the newest alone), and every multiple of ``retain_interval``."""

    keep: int | None = None
    retain_interval: int | None = None

    def kept(self, iterations: list[int]) -> list[int]:
        """The iterations kept of ``iterations`` (any order), ascending."""
        its = sorted(iterations)
        n = self.keep if self.keep is not None else (1 if self.retain_interval else len(its))
        kept = set(its[-n:]) if n > 0 else set()
        if self.retain_interval:
            kept |= {i for i in its if i % self.retain_interval == 0}
        return sorted(kept)


def _flag(args: Any, name: str, default: Any = None) -> Any:
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def load_scope(args: Any, *, finetune: bool | None = None) -> LoadScope:
    """Megatron-LM's load settings as a :class:`LoadScope` (``finetune`` overrides ``--finetune``: a
    ``--pretrained-checkpoint`` load is one)."""
    ft = bool(_flag(args, "finetune", False)) if finetune is None else finetune
    step = _flag(args, "ckpt_step")
    return LoadScope(iteration=int(step) if step else None,
                     optimizer=not (ft or _flag(args, "no_load_optim") or _flag(args, "load_optim", True) is False),
                     rng=not (ft or _flag(args, "no_load_rng") or _flag(args, "load_rng", True) is False),
                     finetune=ft)


def save_scope(args: Any) -> SaveScope:
    """Megatron-LM's save settings (``--no-save-optim``, ``--no-save-rng``) as a :class:`SaveScope`."""
    return SaveScope(optimizer=not (_flag(args, "no_save_optim") or _flag(args, "save_optim", True) is False),
                     rng=not (_flag(args, "no_save_rng") or _flag(args, "save_rng", True) is False))


def retention(args: Any) -> Retention | None:
    """``--tenplex-keep``, ``--most-recent-k`` and ``--save-retain-interval`` as one :class:`Retention` (None: keep
    every checkpoint). The newest N kept is the smaller of --tenplex-keep and --most-recent-k (-1: all)."""
    keeps = [int(k) for k in (_flag(args, "tenplex_keep"), _flag(args, "most_recent_k")) if k is not None and k > 0]
    interval = _flag(args, "save_retain_interval")
    if not keeps and not interval:
        return None
    return Retention(keep=min(keeps) if keeps else None, retain_interval=int(interval) if interval else None)


def retention_problem(args: Any) -> str | None:
    """A retention setting that cannot mean anything (a non-positive --tenplex-keep or --save-retain-interval, a
    --most-recent-k of 0), naming the flag; None when they are fine."""
    for name, flag in (("tenplex_keep", "--tenplex-keep"), ("save_retain_interval", "--save-retain-interval")):
        v = _flag(args, name)
        if v is not None and int(v) < 1:
            return f"{flag} {v}: must be >= 1"
    if _flag(args, "most_recent_k") == 0:
        return "--most-recent-k 0: keep at least one checkpoint (-1: all)"
    return None
