"""Hook a Megatron-LM checkout's training loop: ``--tenplex`` checkpoints and a DP-independent data order.

Use (``patches/megatron-lm-core_v0.16.x.patch`` does this in ``pretrain_gpt.py``)::

    from tenplex_megatron.frontdoor import megatron_lm as tenplex
    tenplex.install()
    pretrain(..., extra_args_provider=tenplex.extra_args_provider(previous_provider))

``install`` wraps ``save_checkpoint``, ``load_checkpoint`` and
``build_pretraining_data_loader`` where ``megatron.training.training`` looks
them up, and ``validate_args`` where ``initialize_megatron`` calls it: with
``--tenplex-layout auto|FILE.json`` TP, PP, VPP, the micro-batch size and, for a mixture of experts, EP and
expert TP are chosen for ``WORLD_SIZE`` there (:func:`choose_layout_for_args`), after Megatron-LM
parsed its flags and before it checks them or builds any process group;
flags given on the command line still win. With ``--tenplex`` a save goes through tenplex and a load re-shards
the newest tenplex checkpoint to the restarted job's layout; a ``--load``
directory holding only Megatron's own checkpoint (``torch_dist`` with any
distributed-optimizer format, or legacy ``torch``) is adopted by tenplex at
the new layout (``megatron_core/native.py``, ``legacy.py``), and later saves
are tenplex checkpoints. With ``--tenplex-memory`` (and its flags, ``tenplex_megatron/flags.py``) a save is
a host-memory snapshot and a load prefers the newest snapshot complete in the live nodes' memory; the wrapped
``maybe_finalize_async_save(terminate=True)`` replicates (and, once training is over, persists) the last one.
With ``--inprocess-restart`` (Megatron-LM's, NVRx's in-process restart) the wrapped
``maybe_wrap_for_inprocess_restart`` lets the survivors of a fault continue in the same processes at a smaller legal
layout (``frontdoor/megatron_lm_inprocess.py``). Without ``--tenplex`` nothing changes.
``--tenplex-init-from-hf DIR`` starts a run whose ``--load`` directory holds no
checkpoint yet from a Hugging Face transformers checkpoint (Megatron-LM calls
``load_checkpoint`` only when ``--load`` is given: give it, empty on the first
start). The padded vocabulary follows Megatron's rule
here (``--make-vocab-size-divisible-by x TP``): when it changes, real rows move
exactly and new padding rows start at zero.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from tenplex_megatron import flags, log, mcore_versions
from tenplex_megatron._optional import require
from tenplex_megatron.engine import orphan
from tenplex_megatron.frontdoor import (
    batch_flags,
    ckpt_flags,
    elastic,
    megatron_lm_inprocess,
    megatron_lm_reform,
    memory_flags,
    reform_runner,
    restart_sources,
    use_checkpoint_args,
)
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.dims import gpt_dims
from tenplex_megatron.frontdoor.engines import MegatronCoreEngine
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.megatron_lm_loader import TenplexBatchSampler, _training_split, with_sampler
from tenplex_megatron.frontdoor.resume import MissingCheckpointError
from tenplex_megatron.integrations.megatron_core.adapter import (
    LiveJob,
    LiveSpec,
    current_layout,
)
from tenplex_megatron.integrations.megatron_core.legacy import legacy_padded_vocab
from tenplex_megatron.integrations.megatron_core.native import saved_padded_vocab
from tenplex_megatron.plan import checkpoint_args, megatron_flags
from tenplex_megatron.plan.layout import LayoutError, restart_padded_vocab_size
from tenplex_megatron.plan.layout_choice import Chosen, LayoutRequest, choose, describe_layout
from tenplex_megatron.plan.megatron_ckpt_flags import refusals
from tenplex_megatron.plan.pipeline_split import rule_of as split_rule_of
from tenplex_megatron.plan.pipeline_split import start_problem as split_problem
from tenplex_megatron.plan.unsupported import missing_transformer_engine, unsupported_flags, unsupported_job_flags
from tenplex_megatron.storage.directory import (
    find_checkpoint,
    find_megatron_checkpoint,
    read_checkpoint_metadata,
)
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import is_legacy_megatron_checkpoint

_log = log.get("megatron_lm")
PROG = "pretrain_gpt.py"
#: where :func:`install` keeps the hook's state: on the module it patches (``megatron.training.training``)
HOOK_ATTRIBUTE = "_tenplex_hook"


class Hook:
    """The installed hook: Megatron-LM's original functions (read-only) and the job's :class:`Checkpointer`, built
    when Megatron-LM checks its flags and closed at exit (or by an in-process restart, which builds the next)."""

    def __init__(self, originals: Mapping[str, Callable[..., Any]]) -> None:
        self.originals: Mapping[str, Callable[..., Any]] = MappingProxyType(dict(originals))
        self.checkpointer: Checkpointer | None = None
        self.in_place: megatron_lm_inprocess.InPlace | None = None  # Megatron-LM's --inprocess-restart, --tenplex
        self.boundary: Any = None  # re-forming on plan (the launcher's --reform): the membership's, during a call

    def checkpointer_for(self, args: Any) -> Checkpointer:
        """The job's Checkpointer, built from Megatron-LM's parsed ``args`` at the first call (the leases claimed,
        before any process group when :func:`_validate_args` calls it; in place, the launcher's claim is the
        process's), closed at exit."""
        if self.checkpointer is None:
            held = self.in_place.leases if self.in_place is not None else None
            # re-forming on plan: the memory tier's helpers started after the world's first iteration (the boundary's
            # first call), not while the world builds and loads
            self.checkpointer = Checkpointer(JobConfig.from_args(args, PROG), held,
                                             helpers_at_open=self.boundary is None)
            atexit.register(self.checkpointer.close)
        return self.checkpointer

    def close(self) -> None:
        """Close the job's Checkpointer (helpers stopped, leases released); the next use builds a new one."""
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None


def installed() -> Hook:
    """The hook :func:`install` put in place (RuntimeError before)."""
    import megatron.training.training as train_mod

    hook = getattr(train_mod, HOOK_ATTRIBUTE, None)
    if hook is None:
        raise RuntimeError("tenplex_megatron.frontdoor.megatron_lm.install() was not called")
    return hook


def _original(name: str) -> Callable[..., Any]:
    return installed().originals[name]


def add_tenplex_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the hook's ``--tenplex*`` flags (``tenplex_megatron/flags.py``) to Megatron-LM's parser."""
    flags.add_flags(parser.add_argument_group("tenplex"), flags.HOOK)
    return parser


_FIXING_FLAGS = MappingProxyType({"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                                  "ep": "--expert-model-parallel-size", "expert_tp": "--expert-tensor-parallel-size",
                                  "micro_batch_size": "--micro-batch-size"})
# Megatron-LM features the layout choice does not model: refused with --tenplex-layout rather than ignored
_UNMODELLED = (("context_parallel_size", 1, "--context-parallel-size"),
               # the choice decides VPP itself (1 or an interleaving): a given one is refused, not ignored
               ("num_layers_per_virtual_pipeline_stage", None, "--num-layers-per-virtual-pipeline-stage"),
               ("num_virtual_stages_per_pipeline_rank", None, "--num-virtual-stages-per-pipeline-rank"),
               ("virtual_pipeline_model_parallel_size", None, "--num-layers-per-virtual-pipeline-stage"))


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def layout_request(args: Any, argv: Sequence[str], world: int, local_world: int) -> LayoutRequest:
    """Megatron-LM's parsed flags as a layout request; a degree given in ``argv`` is fixed (it wins).

    The vocabulary, when the tokenizer sets it (``--vocab-size`` not given), is estimated as GPT-2's: it only
    weighs in the memory and time estimates."""
    for name, default, flag in _UNMODELLED:
        if getattr(args, name, default) not in (default, None):
            raise LayoutError(f"{flag} is not modelled by --tenplex-layout: give the layout explicitly")
    if not getattr(args, "global_batch_size", None):
        raise LayoutError("--global-batch-size is required: the layout choice keeps the global batch fixed")
    dims = gpt_dims(args)
    attr = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "ep": "expert_model_parallel_size", "expert_tp": "expert_tensor_parallel_size",
            "micro_batch_size": "micro_batch_size"}
    fixed = {k: int(getattr(args, attr[k])) for k, flag in _FIXING_FLAGS.items() if _given(argv, flag)}
    return LayoutRequest(args.tenplex_layout, dims, world, local_world, int(args.global_batch_size),
                         memory_gb=elastic.memory_gb(args.tenplex_memory_budget), tp=fixed.get("tp"),
                         pp=fixed.get("pp"), micro_batch_size=fixed.get("micro_batch_size"), ep=fixed.get("ep"),
                         distributed_optimizer=bool(args.use_distributed_optimizer),
                         make_vocab_size_divisible_by=int(args.make_vocab_size_divisible_by),
                         expert_tp=fixed.get("expert_tp"),
                         sequence_parallel=bool(getattr(args, "sequence_parallel", False)), split=split_rule_of(args),
                         batch_sizes=batch_flags.sizes_to_come(args))


def choose_layout_for_args(args: Any, argv: Sequence[str] | None = None) -> Chosen | None:
    """With ``--tenplex-layout``: set ``args``' TP, PP, VPP, micro-batch size (and a mixture of experts' EP and
    expert TP) for torchrun's ``WORLD_SIZE``.

    None without the flag. No legal layout: every refused candidate printed, exit 2, and under torchrun's
    elastic agent the agent is stopped (``frontdoor/elastic.refuse``)."""
    if not getattr(args, "tenplex_layout", None):
        return None
    world, local_world = elastic.world()
    if args.tenplex_layout == "measure":
        elastic.refuse("pretrain_gpt.py", "measure", world, LayoutError(
            "not supported under Megatron-LM (scripts/pretrain_gpt.py has it): give auto or a table"))
    try:
        chosen = choose(layout_request(args, sys.argv[1:] if argv is None else argv, world, local_world))
    except (LayoutError, OSError, ValueError) as e:
        elastic.refuse("pretrain_gpt.py", args.tenplex_layout, world, e)
    args.tensor_model_parallel_size = chosen.layout.tp
    args.pipeline_model_parallel_size = chosen.layout.pp
    args.expert_model_parallel_size = chosen.layout.ep
    moe = bool(getattr(args, "num_experts", None))
    if moe:  # Megatron-LM's validate_args sets TP's only when None
        args.expert_tensor_parallel_size = chosen.layout.expert_tp
    args.micro_batch_size = chosen.micro_batch_size
    if chosen.layout.vpp > 1:  # an interleaved pipeline: Megatron-LM's validate_args derives VPP from it
        args.num_virtual_stages_per_pipeline_rank = chosen.layout.vpp
    sp = bool(getattr(args, "sequence_parallel", False)) and chosen.layout.tp > 1  # Megatron-LM drops SP at TP 1
    _log.info("--tenplex-layout %s: %s (%s)", args.tenplex_layout,
              describe_layout(dataclasses.replace(chosen.layout, sp=sp), chosen.micro_batch_size, moe), chosen.why)
    return chosen


def _have_te() -> bool:
    """Whether megatron-core imports Transformer Engine (its own ``HAVE_TE``, which its layer specs go by)."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def arm_with_tenplex(args: Any) -> str:
    """With ``--tenplex``, a torchrun worker exits when its agent dies (no save, no commit: ``engine/orphan.py``);
    without it nothing is armed, as in the stock script. Returns how it is armed ("" where not)."""
    return orphan.die_with_agent() if getattr(args, "tenplex", False) else ""


def start_check(args: Any, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """What the hook says at start about Megatron-LM's parsed ``args`` and its command line ``argv``: the problems
    that stop the job (every flag --tenplex refuses, ``plan/megatron_flags.py``; the host-memory flags' checks) and
    one note per flag given that has no effect under --tenplex."""
    tenplex = bool(getattr(args, "tenplex", False))
    problems = [*unsupported_flags(args), *unsupported_job_flags(args), *ckpt_flags.start_problems(args),
                *megatron_flags.refusals(args), *filter(None, [missing_transformer_engine(args, _have_te())]),
                # an uneven split that does not fit PP; with --tenplex-layout the choice keeps to it
                *filter(None, [None if getattr(args, "tenplex_layout", None) else split_problem(args)]),
                *batch_flags.start_problems(args)] if tenplex else []
    if hasattr(args, "tenplex_memory"):
        problems.extend(filter(None, [memory_flags.check_memory_args(args)]))
    return problems, [*megatron_flags.no_effect_given(argv), *batch_flags.start_notes(args)] if tenplex else []


def _validate_args(args: Any, *a: Any, **kw: Any) -> Any:
    """Megatron-LM's ``validate_args``, after the hook's start check (:func:`start_check`: refused before any process
    group starts) and the layout choice (which Megatron-LM then checks like any flags)."""
    arm_with_tenplex(args)
    problems, notes = start_check(args, sys.argv[1:])
    for note in notes:
        _log.info("pretrain_gpt.py: %s", note)
    if problems:
        for problem in problems:
            _log.error("pretrain_gpt.py: with --tenplex, %s", problem)
        raise SystemExit(2)
    hook = installed()
    if hook.in_place is not None:  # in place: the gloo/NCCL timeout ours
        args.distributed_timeout_minutes = hook.in_place.settings.timeout / 60
    if hasattr(args, "tenplex_take_over"):  # before any process group: another live job's directory is refused
        try:
            hook.checkpointer_for(args)
        except SystemExit as e:
            _log.error("%s", e.code)
            raise SystemExit(2) from None
    if choose_layout_for_args(args) is not None:  # the chosen DP and micro-batch against the batch schedule
        problems = batch_flags.start_problems(args)
        for problem in problems:
            _log.error("pretrain_gpt.py: with --tenplex, %s", problem)
        if problems:
            raise SystemExit(2)
    return hook.originals["validate_args"](args, *a, **kw)


def layout_reason(args: Any, argv: Sequence[str]) -> Callable[[int], str]:
    """Why the job's flags give no legal layout at a world size ("" when they do): ``--tenplex-layout``'s choice
    (every candidate refused), else Megatron-LM's layout flags as given."""
    _, local = elastic.world()

    def reason(n: int) -> str:
        if not getattr(args, "tenplex_layout", None):
            return megatron_lm_inprocess.fixed_layout_reason(args, n)
        if args.tenplex_layout == "measure":
            return "--tenplex-layout measure: not supported under Megatron-LM (give auto or a table)"
        try:
            choose(layout_request(args, argv, n, local))
        except (LayoutError, OSError, ValueError) as e:
            return f"--tenplex-layout {args.tenplex_layout}: {e}"
        return ""

    return reason


def _maybe_wrap_for_inprocess_restart(pretrain: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    """Megatron-LM's ``maybe_wrap_for_inprocess_restart``; with ``--tenplex`` the wrapper shrinks the world to a
    legal layout instead of ending when no spare is left (``frontdoor/megatron_lm_inprocess.py``); under the
    launcher's ``--reform``/``--join`` ``pretrain`` is called once per world, which grows and shrinks on plan
    (``frontdoor/megatron_lm_reform.py``; a newcomer's model and batch flags must equal the job's)."""
    argv = sys.argv[1:]
    import megatron.training.arguments as args_mod

    if megatron_lm_reform.wanted():  # planned re-forms (the launcher's --reform/--join): no NVRx
        args = args_mod.parse_args(add_tenplex_args, ignore_unknown_args=True)
        flags = reform_runner.job_flags(args, (*(n for n in _RECORDED_ARGS if n != "micro_batch_size"), "vocab_size"))
        return megatron_lm_reform.wrap(pretrain, args, argv, layout_reason(args, argv), installed(), flags)
    if not megatron_lm_inprocess.wanted(argv):
        return _original("maybe_wrap_for_inprocess_restart")(pretrain)
    from megatron.training.inprocess_restart import destroy_state

    args = args_mod.parse_args(add_tenplex_args, ignore_unknown_args=True)
    hook = installed()

    def after_fault() -> None:  # Megatron-LM's own finalize, then the hook's Checkpointer (local: helpers stopped)
        destroy_state()
        hook.close()

    run, store, hook.in_place = megatron_lm_inprocess.wrap(pretrain, args, argv, layout_reason(args, argv),
                                                           after_fault)
    return run, store


def per_call(make: Callable[[], Any]) -> Any:
    """core_v0.18+ (the patch): ``pretrain``'s config, made at each call (a :class:`~.megatron_lm_reform.PerCall`)
    when the job re-forms in place or restarts in place on NVRx, so each call parses its flags for its world."""
    if megatron_lm_inprocess.wanted(sys.argv[1:]):
        return megatron_lm_reform.PerCall(make)
    return megatron_lm_reform.per_call(make)


def _load_args_from_checkpoint(args: Any, load_arg: str = "load", *a: Any, **kw: Any) -> Any:
    """Megatron-LM's ``--use-checkpoint-args`` reader; with ``--tenplex`` the model flags come from the tenplex
    checkpoint's metadata.json (``frontdoor/use_checkpoint_args.py``), a refused checkpoint setting stopping the job
    first; Megatron's own checkpoint is left to its reader."""
    if getattr(args, "tenplex", False):
        problems = refusals(args)
        for problem in problems:
            _log.error("pretrain_gpt.py: with --tenplex, %s", problem)
        if problems:
            raise SystemExit(2)
        if getattr(args, load_arg, None) is None:
            return args
        got = use_checkpoint_args.apply(args, load_arg, sys.argv[1:])
        if got is not None:
            return got
    return _original("load_args_from_checkpoint")(args, load_arg, *a, **kw)


def extra_args_provider(previous: Callable | None = None) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Chain tenplex's flags after an existing ``extra_args_provider``."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if previous is not None:
            parser = previous(parser)
        return add_tenplex_args(parser)

    return provider


_RECORDED_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
    "make_vocab_size_divisible_by", "swiglu", "untie_embeddings_and_output_weights", "bf16", "global_batch_size",
    "micro_batch_size", "train_iters", "lr", "min_lr", "seed", "position_embedding_type", "rotary_base",
    "rotary_percent", "normalization", "norm_epsilon", "add_bias_linear", "group_query_attention", "num_query_groups",
    "qk_layernorm", "apply_layernorm_1p", "sequence_parallel", "fp16",
    "layernorm_epsilon",  # --norm-epsilon's destination in Megatron-LM 0.16 (its TransformerConfig field name)
    # mixture of experts (a dense job records None / the defaults)
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type", "moe_aux_loss_coeff",
    "moe_router_load_balancing_type", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size", "moe_grouped_gemm",
    # routing settings a Hugging Face Mixtral export or import checks (hf_map.MOE_ROUTING)
    "moe_router_pre_softmax", "moe_layer_freq", "moe_router_topk_scaling_factor", "moe_router_num_groups",
    "moe_router_group_topk", "moe_expert_capacity_factor", "moe_input_jitter_eps",
)
# and every other arg --use-checkpoint-args copies (plan/checkpoint_args.py; the padded vocabulary has its own field)
_RECORDED_ARGS += tuple(r.dest for r in checkpoint_args.COPIED
                        if r.dest not in _RECORDED_ARGS and r.dest != "padded_vocab_size")


def _job(model: list[Any], optimizer: Any, scheduler: Any) -> LiveJob:
    from megatron.training import get_args

    args = get_args()
    layout = current_layout(model)
    # The rows Megatron pads are the tokenizer's (``_vocab_size_with_padding(tokenizer.vocab_size)``), not
    # ``--vocab-size``: NullTokenizer adds an EOD token after ``--vocab-size`` tokens.
    from megatron.training import get_tokenizer

    try:
        vocab = get_tokenizer().vocab_size
    except AssertionError:  # no global tokenizer was built
        vocab = args.vocab_size
    spec = LiveSpec(int(vocab), int(args.seed), {k: getattr(args, k, None) for k in _RECORDED_ARGS})
    return LiveJob(model, optimizer, scheduler, layout, spec, int(args.padded_vocab_size),
                         bool(args.use_distributed_optimizer),
                   trust_pickles=bool(getattr(args, "tenplex_trust_pickles", False)))


def save_checkpoint(iteration: int, model: list[Any], optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, *a: Any, **kw: Any) -> None:
    """Megatron-LM's ``save_checkpoint`` signature; tenplex format when ``--tenplex``."""
    from megatron.training import get_args

    args = get_args()
    if not getattr(args, "tenplex", False) or kw.get("non_persistent_ckpt"):
        return _original("save_checkpoint")(iteration, model, optimizer, opt_param_scheduler,
                                            num_floating_point_operations_so_far, *a, **kw)
    job = _job(model, optimizer, opt_param_scheduler)
    job.iteration = iteration
    job.consumed_samples = int(args.consumed_train_samples)
    ckpt = installed().checkpointer_for(args)
    # the validation split's position is Megatron-LM's own loader's: recorded as its own checkpoint records it
    engine = _engine(job, ckpt, {"num_floating_point_operations_so_far": num_floating_point_operations_so_far,
                                 "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0)})
    # a snapshot into node memory (replication and persist go on in the background), else a durable save; a newer
    # generation of this job owning the directory stops this one
    res = ckpt.save(engine)
    if ckpt.tier is not None:
        for line in memory_flags.describe_snapshot(res, iteration):
            _log.info(line)
        return
    _log.info("saved iteration %d to %s in %.2f s", iteration, res.path, res.seconds)


def _engine(job: LiveJob, ckpt: Checkpointer, extra: dict[str, Any] | None = None) -> MegatronCoreEngine:
    """The live job seen by its Checkpointer (``extra``: what a save records beside the state)."""
    return MegatronCoreEngine(job, ckpt.config.verify, ckpt.config.trust_pickles, dict(extra or {}))


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False, *a: Any, **kw: Any) -> Any:
    """Megatron-LM's end-of-checkpointing call (every rank, before each exit and at the end of ``pretrain``); with
    ``--tenplex-memory`` and ``terminate`` the last snapshot is replicated and, once training is over, persisted."""
    hook = installed()
    out = hook.originals["maybe_finalize_async_save"](blocking, terminate, *a, **kw)
    ckpt = hook.checkpointer
    tier = ckpt.tier if ckpt is not None else None
    if terminate and tier is not None and tier.last is not None:
        from megatron.training import get_args

        args = get_args()
        ckpt.finish(over=bool(args.save) and tier.last[0] >= int(args.train_iters or 0), say=_log.info)
    return out


def load_checkpoint(ddp_model: list[Any], optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, *a: Any, **kw: Any) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint`` signature; with ``--tenplex`` the one resume sequence of the job's
    Checkpointer (``frontdoor/resume.py``), re-sharding; Megatron's own loader where the sequence leaves it one."""
    from megatron.training import get_args

    args = get_args()
    megatron_lm_reform.started(installed().boundary)
    job = _job(ddp_model, optimizer, opt_param_scheduler)
    ckpt = installed().checkpointer_for(args)
    try:  # host memory and the checkpoint flags' scope belong to the job's own --load
        got = ckpt.resume(_engine(job, ckpt), getattr(args, load_arg, None), own=load_arg == "load")
    except restart_sources.TenplexCheckpointWithoutFlag as e:  # before Megatron's loader: no traceback, no fresh start
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None
    except CheckpointFileError as e:  # every copy under --load damaged: never a fresh start over them
        raise SystemExit(f"pretrain_gpt.py: error: --{load_arg} {e}") from None
    except MissingCheckpointError:  # --exit-on-missing-checkpoint: Megatron's own loader says it and exits
        return _original("load_checkpoint")(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *a, **kw)
    if got.kind == "hf":
        _log.info("initialised from Hugging Face checkpoint %s at layout %s: %d tensors, %.2f MB read on rank 0",
                  args.tenplex_init_from_hf, job.layout, got.hf.tensors, got.hf.stats.bytes_read / 1e6)
        return 0, 0.0
    if got.result is None:  # Megatron's own checkpoint without --tenplex, or nothing: Megatron's own loader
        return _original("load_checkpoint")(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *a, **kw)
    flops = _resumed(args, job, got.result, got.scope.finetune)
    if got.memory is not None:
        _log.info(memory_flags.describe_memory_load(got.memory, job.layout))
    else:
        _log.info(restart_sources.loaded_line(got.result, job.layout)
                  + (ckpt_flags.describe_scope(got.scope) if got.kind == "scoped" else ""))
    return got.result.iteration, flops


def _resumed(args: Any, job: LiveJob, res: Any, finetune: bool = False) -> float:
    """Megatron-LM's args after a load: the data positions the checkpoint recorded (the validation split's too,
    except in a fine-tune, as Megatron-LM's own loader does); returns its FLOP count."""
    args.consumed_train_samples = job.consumed_samples
    args.skipped_train_samples = 0
    if not finetune and "consumed_valid_samples" in res.extra:
        args.consumed_valid_samples = int(res.extra["consumed_valid_samples"])
    return float(res.extra.get("num_floating_point_operations_so_far", 0.0))


def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
    """Megatron-LM's data-loader builder; with ``--tenplex``, the training split read through the DP-independent
    sampler, in the DataLoader Megatron-LM's own builder makes (its workers, ``--exit-signal-handler``'s
    ``worker_init_fn``, collate, pinning): only the sampler differs. The validation and test splits are Megatron-LM's
    own loaders (their batch sizes, ``--full-validation``; their position is ``consumed_valid_samples``)."""
    from megatron.training import get_args

    args = get_args()
    original = _original("build_pretraining_data_loader")
    if dataset is None or not getattr(args, "tenplex", False) or consumed_samples is None \
            or getattr(args, "dataloader_type", None) == "external" \
            or not _training_split(dataset):  # external: the dataset is its own loader
        return original(dataset, consumed_samples)
    import torch
    from megatron.core import mpu

    stock = original(dataset, 0)  # its settings are taken; its sampler (at the start: always in range) is not
    if not isinstance(stock, torch.utils.data.DataLoader):
        return stock
    sampler = TenplexBatchSampler(len(dataset), consumed_samples, batch_flags.schedule_for_args(args),
                                  args.micro_batch_size,
                                  mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())
    return with_sampler(stock, sampler)


def _vocab_size_with_padding(orig_vocab_size: int, args: Any, *a: Any, **kw: Any) -> int:
    """Megatron-LM's padded vocabulary; with ``--tenplex`` (``keep``) a restart keeps the checkpoint's when TP divides it.

    Megatron's softmax covers the padding rows, so a different padded size is a
    slightly different model: keeping it makes the resumed losses continue exactly.
    """
    padded = _original("_vocab_size_with_padding")(orig_vocab_size, args, *a, **kw)
    if not getattr(args, "tenplex", False) or getattr(args, "tenplex_vocab_padding", "keep") != "keep" \
            or not getattr(args, "load", None):
        return padded
    ckpt = find_checkpoint(args.load)
    mck = find_megatron_checkpoint(args.load) if ckpt is None else None
    if ckpt is not None:
        saved = read_checkpoint_metadata(ckpt).padded_vocab_size
    elif mck is not None:
        read = legacy_padded_vocab if is_legacy_megatron_checkpoint(mck) else saved_padded_vocab
        saved = read(mck, trust_pickles=getattr(args, "tenplex_trust_pickles", False))
    else:
        return padded
    kept = restart_padded_vocab_size(orig_vocab_size, args.make_vocab_size_divisible_by,
                                     args.tensor_model_parallel_size, saved)
    if kept != padded:
        _log.info("keeping the checkpoint's padded vocab %d (Megatron's rule at this TP: %d)", kept, padded)
    return kept


def install() -> None:
    """Wrap Megatron-LM's checkpoint, data-loader, vocabulary-padding and argument-checking functions (idempotent)."""
    train_mod = require("megatron.training.training", "megatron-lm", needed_by=__name__,
                        note="megatron.training is Megatron-LM's, from a core_v0.15.x-0.19.x checkout on PYTHONPATH")
    import importlib

    import megatron.training.arguments as args_mod
    import megatron.training.checkpointing as ckpt_mod
    import megatron.training.initialize as init_mod

    if getattr(train_mod, HOOK_ATTRIBUTE, None) is not None:
        return
    mcore_versions.check_nvrx()  # where megatron-core's own import did not assert it first: named, with the fix
    originals: dict[str, Callable[..., Any]] = {}
    # core_v0.18+: pretrain_gpt.py checks its flags in arguments.parse_and_validate_args; before, initialize_megatron
    # calls the validate_args it imported by name
    checks = args_mod if hasattr(args_mod, "parse_and_validate_args") else init_mod
    originals["validate_args"] = checks.validate_args
    # --use-checkpoint-args reads them before validate_args (from a tenplex checkpoint: use_checkpoint_args.py)
    args_readers = [mod for mod in (init_mod, ckpt_mod) if hasattr(mod, "load_args_from_checkpoint")]
    if args_readers:
        originals["load_args_from_checkpoint"] = args_readers[0].load_args_from_checkpoint
    # the vocabulary padding: megatron.training's tokenizer up to core_v0.16, megatron.core's tokenizers from 0.17
    tok_mod, tok_name = None, ""
    for module, name in (("megatron.training.tokenizer.tokenizer", "_vocab_size_with_padding"),
                         ("megatron.core.tokenizers.utils.build_tokenizer", "vocab_size_with_padding")):
        try:
            tok_mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(tok_mod, name):
            originals["_vocab_size_with_padding"], tok_name = getattr(tok_mod, name), name
            break
    originals["save_checkpoint"] = ckpt_mod.save_checkpoint
    originals["load_checkpoint"] = ckpt_mod.load_checkpoint
    originals["build_pretraining_data_loader"] = train_mod.build_pretraining_data_loader
    originals["maybe_finalize_async_save"] = train_mod.maybe_finalize_async_save
    originals["checkpoint_and_decide_exit"] = train_mod.checkpoint_and_decide_exit
    # Megatron-LM's --inprocess-restart (NVRx's wrapper at a fixed world): with --tenplex, one that shrinks
    try:
        restart_mod: Any = importlib.import_module("megatron.training.inprocess_restart")
        originals["maybe_wrap_for_inprocess_restart"] = restart_mod.maybe_wrap_for_inprocess_restart
    except (ImportError, AttributeError):
        restart_mod = None
    setattr(train_mod, HOOK_ATTRIBUTE, Hook(originals))  # before any wrapper can run
    checks.validate_args = _validate_args
    if tok_name:
        setattr(tok_mod, tok_name, _vocab_size_with_padding)
    for mod in (ckpt_mod, train_mod):
        mod.save_checkpoint = save_checkpoint
        mod.load_checkpoint = load_checkpoint
    train_mod.build_pretraining_data_loader = build_pretraining_data_loader
    train_mod.maybe_finalize_async_save = maybe_finalize_async_save
    # re-forming on plan: the membership asked at each iteration boundary (nothing otherwise)
    train_mod.checkpoint_and_decide_exit = megatron_lm_reform.boundary_exit(
        originals["checkpoint_and_decide_exit"], lambda: installed().boundary)
    for mod in args_readers:
        mod.load_args_from_checkpoint = _load_args_from_checkpoint
    if restart_mod is not None:  # pretrain_gpt.py looks it up on the module when it starts (after install)
        restart_mod.maybe_wrap_for_inprocess_restart = _maybe_wrap_for_inprocess_restart
