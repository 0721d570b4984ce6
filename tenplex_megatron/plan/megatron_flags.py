"""Every flag of Megatron-LM's ``pretrain_gpt.py`` under ``--tenplex``: neutral, honoured, refused at start, or of no
effect, with why.

- *neutral*: a layout change leaves its meaning alone and the plugin has no stake in it (logging, profiling, model
  shape, hyper-parameters, kernels, features of other scripts); Megatron-LM does with it what it always does.
- *honoured*: the plugin's tests show it across a layout change (the layout itself, the sampler's batch sizes, the
  mixture-of-experts settings the restarts use, the checkpoint settings ``megatron_ckpt_flags.py`` honours).
- *refused*: the hook stops the job at start (before any process group), naming the flag and why, where a re-shard
  cannot keep it right today; each why says what it would take.
- *no effect*: the checkpoint settings tenplex's own save and load replace; given on the command line, the hook says
  so in one line at start.

One place holds each fact: ``megatron_ckpt_flags.py`` (checkpoint settings) and ``unsupported.py`` (features
refused in a job and in saved args) stay the tables for what they cover and are read here; this module adds the
honoured groups and the refusals of everything else, ``megatron_flags_neutral.py`` the neutral groups and the few
prefix rules. ``tests/unit/test_megatron_flags.py`` fails on any flag of any line of the snapshot
(``megatron_flag_snapshot.py``) that none of them classifies. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan import megatron_ckpt_flags as ckpt
from tenplex_megatron.plan import megatron_flag_snapshot as snap
from tenplex_megatron.plan.megatron_flags_neutral import NEUTRAL, NEUTRAL_GROUPS, RULES, Group
from tenplex_megatron.plan.unsupported import UNSUPPORTED

HONOURED, REFUSED, NO_EFFECT = ckpt.HONOURED, ckpt.REFUSED, ckpt.NO_EFFECT
VERDICTS = (NEUTRAL, HONOURED, REFUSED, NO_EFFECT)
HERE = "plan/megatron_flags.py"


@dataclass(frozen=True)
class Refusal:
    """A flag refused at start unless its value is one of ``accepted`` (the first: Megatron-LM's default)."""

    dest: str
    flag: str
    accepted: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class Verdict:
    """What ``--tenplex`` does with one destination, why, and the table that says so."""

    dest: str
    verdict: str
    why: str
    table: str


_TE = ("low-precision compute through Transformer Engine: the parameters stay bf16 or fp32 and re-shard like any; "
       "TE's scaling state (_extra_state) is restored at the same layout and left out with one warning at a new one, "
       "where it re-warms (tests/unit/test_te_extra_state.py; FP8 itself has not run: it needs TE and a GPU)")

HONOURED_GROUPS: tuple[Group, ...] = (
    Group(HONOURED, "the layout a restart changes, re-sharded to the new one (tests/megatron_lm: TP2 -> TP1 x DP2, "
          "PP2 x VPP2 -> TP2, TP2 + SP -> TP1 x DP2, the plain and the distributed optimizer; "
          "tests/multiproc/test_reshard_matrix.py: TP, PP, VPP and DP changes)",
          ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
           "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "use_distributed_optimizer")),
    Group(HONOURED, "a mixture of experts restarted at a new EP, expert TP, TP or PP (tests/megatron_lm -k moe: "
          "4 experts, top-2, the load-balancing loss, the allgather and alltoall dispatchers; the flex dispatcher "
          "moves tokens only)",
          ("num_experts", "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_ffn_hidden_size",
           "moe_router_topk", "moe_aux_loss_coeff", "moe_token_dispatcher_type")),
    Group(HONOURED, "the aux-loss-free expert bias (its state saved and re-sharded), sigmoid routing and shared "
          "experts (tests/multiproc/test_reshard_matrix.py: EP2 x expert DP2 -> EP4; test_megatron_adopt.py); the "
          "other load-balancing types are a loss or none, and core_v0.19's quantile balancing keeps a per-expert "
          "bias buffer as the expert bias does",
          ("moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_score_function",
           "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type")),
    Group(HONOURED, "megatron-core's GroupedMLP re-sharded at a new EP, expert TP or TP (tests/multiproc/"
          "test_reshard_matrix.py -k grouped); with --transformer-impl transformer_engine and without "
          "--moe-use-legacy-grouped-gemm (TE's TEGroupedMLP, not run) refused at start by plan/unsupported.py",
          ("moe_grouped_gemm", "moe_use_legacy_grouped_gemm")),
    Group(HONOURED, "local: megatron-core's own layers (every test); transformer_engine: refused at start where "
          "Transformer Engine cannot be imported (plan/unsupported.py), else its layers re-shard like any and its "
          "_extra_state is kept per rank (tests/unit/test_te_extra_state.py; TE has not run)", ("transformer_impl",)),
    Group(HONOURED, "overlapped grad reduce and param gather in 4,000-element buckets, each side of a TP <-> DP "
          "change (tests/multiproc/test_reshard_matrix.py -k overlapped); Megatron-LM finishes the param all-gather "
          "before it saves", ("overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size")),
    Group(HONOURED, "bf16, and fp16 with a static or dynamic loss scaler whose state comes back (tests/megatron_lm: "
          "fp16 TP2 -> TP1 x DP2; tests/multiproc/test_reshard_matrix.py: bf16 and fp16)",
          ("fp16", "bf16", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")),
    Group(HONOURED, "tenplex's sampler: global batch i holds samples [i x G, (i+1) x G) at any DP size and "
          "micro-batch size (tests/unit/test_megatron_lm_sampler.py; the tests/megatron_lm restarts)",
          ("global_batch_size", "micro_batch_size")),
    Group(HONOURED, "the training split's DataLoader is the one Megatron-LM's builder makes, its sampler alone "
          "replaced by tenplex's: its workers (persistent), --exit-signal-handler's worker_init_fn in each worker, "
          "its collate (tests/megatron_lm/test_megatron_lm_user_flags.py -k exit_signal_handler: --num-workers 1, "
          "TP2 -> TP1 x DP2)", ("exit_signal_handler", "num_workers")),
    Group(HONOURED, "the validation and test splits are Megatron-LM's own loaders, with their own batch sizes and "
          "--full-validation's sampler: each evaluation covers the same samples at any DP size, and their position "
          "(consumed_valid_samples) is recorded in the tenplex checkpoint and restored as Megatron-LM's own load does "
          "(tests/megatron_lm/test_megatron_lm_user_flags.py -k eval: the validation losses after TP2 -> TP1 x DP2 "
          "equal the uninterrupted run's; -k full_validation: with --multiple-validation-sets, TP1 x DP2 -> DP1, "
          "the same; without that flag Megatron-LM's own --full-validation stops at its first evaluation, with or "
          "without --tenplex, on core_v0.16.1 and core_v0.19.0; the evaluation batch sizes exist from core_v0.18)",
          ("eval_micro_batch_size", "eval_global_batch_size", "full_validation")),
    Group(HONOURED, "Megatron-LM's batch-size ramp (core_v0.15-0.17; from 0.18 Megatron-LM parses and ignores it, and "
          "so does the sampler) and core_v0.18's step schedule: the global batch at consumed sample c is Megatron-LM's "
          "own for c, samples [c, c + g(c)) at any DP size; a restart inside the ramp resumes at the saved position, "
          "and batch sizes still to come that micro-batch x the new DP size does not divide are refused at start "
          "(--tenplex-layout chooses only a micro-batch x DP dividing them) "
          "(tests/unit/test_batch_schedule.py, test_layout_choice.py; tests/megatron_lm/test_megatron_lm_rampup.py: DP2 saved inside the ramp "
          "-> TP2, core_v0.16.1's ramp and core_v0.19.0's step schedule)",
          ("rampup_batch_size", "step_batch_size_schedule")),
    Group(HONOURED, "the padded vocabulary: the checkpoint's kept when the new TP divides it, else the real rows "
          "move and new padding rows start at zero (tests/megatron_lm: vocabularies of 95 and 96, TP2 -> TP1 x DP2)",
          ("vocab_size", "make_vocab_size_divisible_by")),
    Group(HONOURED, "tied or untied embeddings at any PP (tests/multiproc/test_reshard_matrix.py; the exports at "
          "PP2)", ("untie_embeddings_and_output_weights",)),
    Group(HONOURED, "the RNG: restored at the same layout, re-seeded from (seed, iteration) at a new one "
          "(tests/multiproc/test_reshard_matrix.py)", ("seed",)),
    Group(HONOURED, "NVRx's in-process restart: the survivors go on at a smaller legal layout in the same processes "
          "(tests/megatron_lm/test_megatron_lm_inprocess.py: core_v0.16.1 with NVRx 0.4.1 and 0.5.0, core_v0.17.1, 0.18.2 and 0.19.0 with 0.7.0; "
          "from core_v0.18 the patch's flag reading is made again at each call)",
          ("inprocess_restart", "inprocess_active_world_size")),
    Group(HONOURED, "uneven pipeline stages: the layout records each model chunk's layers (plan/pipeline_split.py, "
          "equal to megatron-core's get_transformer_layer_offset and get_num_layers_to_build over every small "
          "configuration: tests/unit/test_pipeline_split.py) and a restart re-shards by global layer to any other "
          "split or PP (tests/multiproc/test_uneven_pipeline.py: PP2 3/1 -> PP2 even, 1/3, the layout string, PP1; "
          "PP1 -> PP2 3/1; PP2 x VPP2 -> PP1; the account-for split -> PP1; tests/megatron_lm -k uneven); a split "
          "that does not fit the PP is refused at start naming the flags and numbers",
          ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")),
    Group(HONOURED, _TE, ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
                          "fp8_wgrad", "fp4", "fp4_recipe", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                          "num_layers_at_end_in_bf16", "te_precision_config_file", "fp8_quantizer_factory",
                          "fp4_quantizer_factory", "fp8_output_proj")),
)

_PRECISION = ("the precision-aware optimizer is Transformer Engine's FusedAdam: megatron-core's OptimizerConfig "
              "refuses it without TE (core_v0.16 fails in is_te_min_version, core_v0.19 raises '--use-precision-"
              "aware-optimizer requires FusedAdam from TransformerEngine'; its one other host, --optimizer-cpu-offload, "
              "is refused too), so it cannot run on tenplex's CPU runners. Its moments and main weights live in "
              "FusedAdam's state in the dtypes given, which tenplex does not describe (it saves fp32 moments and main "
              "weights); honouring it would take describing that state (and TE's store_param_remainders) and a "
              "restart test on a GPU with TE comparing the re-sharded moments element by element")
_QUANTIZED = ("parameters kept quantized (Transformer Engine's FP8 or FP4 tensors, their scales per rank): tenplex "
              "describes bf16 and fp32 parameters; it would take reading and re-sharding TE's quantized parameters")
_HETERO = ("heterogeneous blocks (a shape per layer) have not run with tenplex, whose layer-stacked tensors have one "
           "shape per key; it would take describing per-layer shapes and a restart test")
_GLU = ("GLU weights interleaved in blocks: tenplex's SwiGLU description splits the gate and up halves as "
        "megatron-core's factory does; it would take describing the interleaved layout and a test at an expert-TP "
        "change")
_GTP = ("weights sharded beyond TP (core_v0.19's weight-rematerialisation shards) have not run with tenplex; it "
        "would take describing the extra shard axis and a restart test")
_TE_GROUPED = ("an MLP built as Transformer Engine's GroupedLinear, whose weights tenplex has not described (TE has "
               "not run with tenplex); it would take a restart test with TE")
_KITCHEN = ("quantization through NVIDIA's Kitchen extension (per-layer quantizers) has not run with tenplex; it would "
            "take describing the quantizers' state and a restart test")
REFUSALS: tuple[Refusal, ...] = (
    Refusal("decrease_batch_size_if_needed", "--decrease-batch-size-if-needed", (False,),
            "a global batch shrunk to fit the DP size would change which samples batch i holds (tenplex's sampler "
            "keeps --global-batch-size at any DP size); it would take the sampler following the shrink"),
    Refusal("use_precision_aware_optimizer", "--use-precision-aware-optimizer", (False,), _PRECISION),
    Refusal("exp_avg_dtype", "--exp-avg-dtype", ("fp32",), _PRECISION),
    Refusal("exp_avg_sq_dtype", "--exp-avg-sq-dtype", ("fp32",), _PRECISION),
    Refusal("main_params_dtype", "--main-params-dtype", ("fp32",), _PRECISION),
    Refusal("main_grads_dtype", "--main-grads-dtype", ("fp32",), _PRECISION),
    Refusal("optimizer_cpu_offload", "--optimizer-cpu-offload", (False,),
            "the optimizer's state offloaded to the CPU (megatron-core's HybridDeviceOptimizer) is not in the buffers "
            "tenplex describes; it would take describing the offloaded state and a restart test"),
    Refusal("optimizer", "--optimizer", ("adam",),
            "tenplex describes and re-shards Adam's state (exp_avg, exp_avg_sq, step); SGD's momentum and Muon's, "
            "Lion's and SOAP's states are not described: it would take describing each and a restart test"),
    Refusal("mtp_num_layers", "--mtp-num-layers", (None, 0),
            "multi-token prediction layers sit after the decoder on the last pipeline stage (or a stage of their own), "
            "outside tenplex's layers-per-stage layout model; it would take the model counting them and a restart "
            "test at a PP change"),
    Refusal("multi_latent_attention", "--multi-latent-attention", (False,),
            "multi-latent attention's low-rank query and key-value projections and their norms have not been "
            "re-sharded by tenplex; it would take a restart test at a TP change"),
    Refusal("experimental_attention_variant", "--experimental-attention-variant", (None,),
            "gated delta net and DeepSeek sparse attention have not run with tenplex (their packed projections, the "
            "indexer's weights); it would take a restart test at a TP change"),
    Refusal("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path", (None,), _HETERO),
    Refusal("heterogeneous_layers_config_encoded_json", "--heterogeneous-layers-config-encoded-json", (None,),
            _HETERO),
    Refusal("fp8_param_gather", "--fp8-param-gather", (False,), _QUANTIZED),
    Refusal("fp4_param_gather", "--fp4-param-gather", (False,), _QUANTIZED),
    Refusal("fp4_param", "--fp4-param-gather", (False,), _QUANTIZED),
    Refusal("tensor_parallel_num_weight_shards", "--tensor-parallel-num-weight-shards", (None,), _GTP),
    Refusal("expert_tensor_parallel_num_weight_shards", "--expert-tensor-parallel-num-weight-shards", (None,), _GTP),
    Refusal("use_grouped_gemm_for_dense_mlp", "--use-grouped-gemm-for-dense-mlp", (False,), _TE_GROUPED),
    Refusal("use_grouped_gemm_for_shared_expert", "--use-grouped-gemm-for-shared-expert", (False,), _TE_GROUPED),
    Refusal("kitchen_config_file", "--kitchen-config-file", (None,), _KITCHEN),
    Refusal("kitchen_recipe_number", "--kitchen-recipe-number", (None,), _KITCHEN),
    Refusal("use_legacy_models", "--use-legacy-models", (False,),
            "Megatron-LM's legacy models (megatron.legacy.model) describe no sharded state; tenplex re-shards "
            "megatron-core's models"),
    Refusal("moe_layer_freq", "--moe-layer-freq", (1,),
            "dense and MoE layers mixed: each kind's tensors then cover only some layers, which no tenplex test has "
            "re-sharded; it would take a restart test at a PP and an EP change"),
    Refusal("moe_latent_size", "--moe-latent-size", (None,),
            "latent MoE projections have not run with tenplex; it would take a restart test at an EP change"),
    Refusal("moe_use_upcycling", "--moe-use-upcycling", (False,),
            "upcycling converts a dense checkpoint through Megatron's own distributed checkpointing, which --tenplex "
            "replaces: upcycle without --tenplex, then restart with it"),
    Refusal("moe_mlp_glu_interleave_size", "--moe-mlp-glu-interleave-size", (None,), _GLU),
    Refusal("moe_shared_expert_glu_interleave_size", "--moe-shared-expert-glu-interleave-size", (None,), _GLU),
    Refusal("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", (1,),
            "several distributed-optimizer instances (the state sharded within each, replicated across them) have "
            "not run with tenplex; it would take a restart test that changes them"),
    Refusal("use_tp_pp_dp_mapping", "--use-tp-pp-dp-mapping", (False,),
            "the tp-cp-ep-pp-dp rank order: a live load goes by megatron-core's coordinates, but tenplex's layout "
            "model (--tenplex-layout, plan) assumes the default order; it would take the model knowing the order"),
    Refusal("fake_process_group", "--fake-process-group", (False,),
            "a fake process group skips every collective, and tenplex's save and load are collectives: a checkpoint "
            "would be incomplete"),
    Refusal("perform_rl_step", "--perform-rl-step", (False,),
            "RL rollouts replace the dataset whose position tenplex's sampler keeps; it would take describing the "
            "rollout state and a restart test"),
    Refusal("phase_transition_iterations", "--phase-transition-iterations", (None,),
            "data phases (a dataset per phase, its position counted from the last transition) have not run with "
            "tenplex's sampler; it would take a restart test across a transition"),
    Refusal("logits_load_dir", "--logits-load-dir", (None,),
            "cached teacher log-probabilities are not shown to follow tenplex's sampler, which orders each DP rank's "
            "samples otherwise than Megatron-LM's; it would take keying them by sample and a test"),
    Refusal("modelopt_enabled", "--modelopt-enabled", (False, None),
            "ModelOpt's model (quantizers, a distillation teacher) has state tenplex does not describe; Megatron-LM "
            "also sets it when its own loader finds a ModelOpt checkpoint, which tenplex's load replaces"),
)


def _explicit() -> list[Verdict]:
    """Every row of every table, in the order the tables are read (a destination twice is a bug: see
    :func:`duplicates`)."""
    rows = [Verdict(n, s.verdict, s.why, "plan/megatron_ckpt_flags.py") for s in ckpt.SETTINGS for n in s.names]
    rows += [Verdict(attr, REFUSED, why, "plan/unsupported.py") for attr, _, _, why in UNSUPPORTED]
    rows += [Verdict(r.dest, REFUSED, r.why, HERE) for r in REFUSALS]
    rows += [Verdict(d, g.verdict, g.why, HERE) for g in HONOURED_GROUPS for d in g.dests]
    rows += [Verdict(d, g.verdict, g.why, "plan/megatron_flags_neutral.py") for g in NEUTRAL_GROUPS for d in g.dests]
    return rows


EXPLICIT: Mapping[str, Verdict] = MappingProxyType({v.dest: v for v in _explicit()})


def duplicates() -> list[str]:
    """Destinations more than one table row classifies (none: each fact has one place)."""
    seen: set[str] = set()
    twice = [v.dest for v in _explicit() if v.dest in seen or seen.add(v.dest)]  # type: ignore[func-returns-value]
    return sorted(set(twice))


def classify(dest: str) -> Verdict | None:
    """The verdict on one destination: a table's row, else a prefix rule's; None when nothing classifies it."""
    if dest in EXPLICIT:
        return EXPLICIT[dest]
    rule = next((r for r in RULES if dest.startswith(r.prefix)), None)
    return Verdict(dest, rule.verdict, rule.why, f"plan/megatron_flags_neutral.py (rule {rule.prefix}*)") \
        if rule is not None else None


def unclassified(dests: Iterable[str]) -> list[str]:
    """The destinations among ``dests`` that nothing classifies."""
    return sorted({d for d in dests if classify(d) is None})


def refusals(args: Any) -> list[str]:
    """One line per flag of :data:`REFUSALS` that ``args`` (Megatron-LM's parsed flags) sets to a value --tenplex
    refuses, naming the flag, the value and why (``megatron_ckpt_flags.refusals`` and ``unsupported.py`` say theirs)."""
    out = []
    for r in REFUSALS:
        value = args.get(r.dest, r.accepted[0]) if isinstance(args, dict) else getattr(args, r.dest, r.accepted[0])
        if not ckpt.accepts(value, r.accepted):
            out.append(f"{r.flag}{_shown(value)}: {r.why}")
    return out


def _shown(value: Any) -> str:
    """A flag's value as the command line gives it: nothing for a switch, items space-separated for a list."""
    if value is True:
        return ""
    return " " + (" ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))


def _given(argv: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def no_effect_given(argv: Sequence[str], options: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """One line per checkpoint setting of no effect under --tenplex given in ``argv`` (Megatron-LM's command line),
    naming the option as given and why; ``options``: every option string of each destination (default: the
    snapshot's, else the table's flag)."""
    if options is None:
        try:
            options = snap.read().options()
        except (OSError, snap.FlagSnapshotError):
            options = {}
    out = []
    for s in (s for s in ckpt.SETTINGS if s.verdict == NO_EFFECT):
        for option in sorted({s.flag, *(o for n in s.names for o in options.get(n, ()) if o.startswith("--"))}):
            if _given(argv, option):
                out.append(f"{option} has no effect under --tenplex: {s.why}")
    return out


def counts(line: snap.Line) -> dict[str, int]:
    """How many of a line's destinations each verdict covers (``unclassified``: none, when the tests pass)."""
    out = dict.fromkeys((*VERDICTS, "unclassified"), 0)
    for dest in line.dests():
        v = classify(dest)
        out[v.verdict if v is not None else "unclassified"] += 1
    return out


def refused(snapshot: snap.Snapshot) -> list[tuple[Verdict, tuple[str, ...], tuple[str, ...]]]:
    """Every refused destination of the snapshot: its verdict, its options and the lines that have it, in the
    tables' order."""
    options = snapshot.options()
    lines = {d: tuple(x.name for x in snapshot.lines if d in set(x.dests())) for d in options}
    rows = [classify(d) for d in options]
    order = {v.dest: i for i, v in enumerate(_explicit())}
    got = sorted((v for v in rows if v is not None and v.verdict == REFUSED), key=lambda v: order.get(v.dest, 1 << 30))
    return [(v, options[v.dest], lines[v.dest]) for v in got]
