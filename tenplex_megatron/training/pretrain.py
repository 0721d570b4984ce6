"""GPT pre-training on megatron-core that speaks Megatron-LM's flags, plus ``--tenplex``.

``scripts/pretrain_gpt.py`` is a thin wrapper around :func:`main`; from an
installed package, ``torchrun ... -m tenplex_megatron.training.pretrain`` runs
the same. Flags keep
Megatron-LM's names and meanings; an unknown or unsupported flag is an error
naming it. With ``--tenplex`` checkpoints are saved and loaded through
tenplex, re-sharded to whatever layout the restarted job has; without it,
through megatron-core's dist_checkpointing (torch_dist, dp_reshardable by default), as
Megatron-LM does. With ``--tenplex``, a ``--load`` directory that holds only a
megatron-core checkpoint is adopted by tenplex at whatever layout the job has
(``integrations/megatron_core/native.py``); later saves are tenplex checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from types import MappingProxyType
from typing import Any, TextIO

import psutil
import torch
from megatron.core import parallel_state

from tenplex_megatron import flags
from tenplex_megatron.engine import orphan
from tenplex_megatron.frontdoor import ckpt_flags, memory_flags, slurm
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.membership import LEAVES_ENV, REFORM_ENV
from tenplex_megatron.integrations.megatron_core.optimizer import sub_optimizers
from tenplex_megatron.plan.data_position import microbatch_sample_indices
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_choice import describe_layout
from tenplex_megatron.plan.unsupported import UNSUPPORTED
from tenplex_megatron.training import (
    checkpoints,
    gpt,
    inprocess,
    layout_choice,
    measure,
    pipeline_flags,
    reform,
)
from tenplex_megatron.training.console import print0 as _print0
from tenplex_megatron.training.console import print_tenplex
from tenplex_megatron.training.data import build_train_dataset, check_data_path, microbatches_from_dataset
from tenplex_megatron.training.gpt import GPTSpec
from tenplex_megatron.training.signals import StopOnSignal
from tenplex_megatron.training.synthetic_data import microbatches
from tenplex_megatron.training.tokenizer import (
    TokenizerError,
    TokenizerSpec,
    add_tokenizer_args,
    build_tokenizer,
    describe,
)

PROG = "pretrain_gpt.py"

#: Megatron-LM flags the reference trainer refuses, with why (plan/unsupported.py: the Megatron-LM hook's list)
MEGATRON_FLAGS_NOT_SUPPORTED = MappingProxyType({flag: why for _, _, flag, why in UNSUPPORTED})


def _model_flags(g: argparse._ArgumentGroup) -> None:
    """The model's shape, precision and fp16 loss scaling (Megatron-LM's names and defaults)."""
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    add_tokenizer_args(g, "NullTokenizer", "NullTokenizer (--mock-data: --vocab-size ids; --data-path: byte-level), "
                       "ByteLevel, GPT2BPETokenizer, HuggingFaceTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period (with rope)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of each head's dimensions rotated (rope)")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in the linear layers (QKV, projection, MLP)")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="key/value head groups (with --group-query-attention)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="fp16 weights with fp32 main weights and loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16: a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="fp16: the dynamic scale's start")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: steps without overflow before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows in a row before the scale halves")


def _parallelism_flags(g: argparse._ArgumentGroup) -> None:
    """TP, PP, VPP, sequence parallelism and the data-parallel gradient and optimizer options."""
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, help="default 1 (or chosen: --tenplex-layout)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="default 1 (or chosen)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline: layers per virtual stage (VPP = layers / PP / this)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved pipeline: virtual stages (model chunks) per pipeline rank (VPP)")
    pipeline_flags.add_split_flags(g)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the sequence over the TP ranks outside attention and MLP (off at TP 1, as in "
                   "Megatron-LM)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients over DP in buckets, overlapped with the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather the distributed optimizer's updated weights overlapped with the next forward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per bucket with --overlap-grad-reduce (default: max(40M, 1M x DP))")


def _moe_flags(g: argparse._ArgumentGroup) -> None:
    """A mixture of experts: routing, experts' width, EP and expert TP."""
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (default: dense MLPs)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN width (default: "
                   "--ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="the load-balancing loss's weight")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias updated from the tokens each expert got")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN width of the shared experts every token also goes through (default: none)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="megatron-core's grouped-GEMM experts (GroupedMLP: each layer's local experts in two "
                   "weights, the grouped_gemm package's gmm; needs --bf16 and --disable-bias-linear) instead of "
                   "SequentialMLP's; a checkpoint re-shards only into the same kind of experts")
    g.add_argument("--expert-model-parallel-size", type=int, default=None, help="expert parallelism (EP): ranks "
                   "the experts are divided among; must divide --num-experts (default 1, or chosen by --tenplex-layout)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)")


def _training_flags(g: argparse._ArgumentGroup) -> None:
    """Batch sizes, iterations, the learning-rate schedule and the optimizer."""
    g.add_argument("--micro-batch-size", type=int, default=None, help="required unless --tenplex-layout chooses it")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--seed", type=int, default=1234)


def _data_flags(g: argparse._ArgumentGroup) -> None:
    """Mock data or megatron-core's GPTDataset."""
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")


def _checkpoint_flags(g: argparse._ArgumentGroup) -> None:
    """Where and how often to save and load without tenplex, and the log interval."""
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="without --tenplex: megatron-core's dist_checkpointing (torch_dist) or Megatron-LM's legacy "
                   "per-rank files (torch; read back with --tenplex)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="without --tenplex: save the distributed optimizer as fully_reshardable (megatron-core can "
                   "re-shard it along TP/PP) instead of Megatron-LM's default dp_reshardable")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="with --tenplex: load this iteration's checkpoint (at this job's layout) instead of the newest")
    g.add_argument("--finetune", action="store_true",
                   help="with --tenplex: load the weights alone and start at iteration 0 with a fresh optimizer, LR "
                   "schedule and data position")
    g.add_argument("--pretrained-checkpoint", default=None, metavar="DIR",
                   help="with --tenplex: when --load holds no checkpoint, fine-tune from the one in DIR")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --tenplex: load the weights alone (fresh optimizer and LR schedule)")
    g.add_argument("--no-load-rng", action="store_true", help="with --tenplex: leave the saved RNG state alone")
    g.add_argument("--no-save-optim", action="store_true",
                   help="with --tenplex: weights-only checkpoints (a load from one needs --no-load-optim or --finetune)")
    g.add_argument("--no-save-rng", action="store_true", help="with --tenplex: checkpoints without RNG state")
    g.add_argument("--save-retain-interval", type=int, default=None, metavar="N",
                   help="with --tenplex: besides the newest, keep every checkpoint whose iteration is a multiple of N")
    g.add_argument("--most-recent-k", type=int, default=None, metavar="K",
                   help="with --tenplex: keep the newest K checkpoints (-1: all; with --tenplex-keep the smaller)")
    g.add_argument("--async-save", action="store_true",
                   help="with --tenplex: a save returns once the state is in host memory (--tenplex-memory's "
                   "directory, by default in /dev/shm); a helper process writes it to --save in the background, "
                   "committed before the next save and at exit")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="--load holds no checkpoint: exit instead of starting from scratch")
    g.add_argument("--log-interval", type=int, default=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pre-training on megatron-core with Megatron-LM's flags and --tenplex.",
        allow_abbrev=False,
    )
    _model_flags(p.add_argument_group("model"))
    _parallelism_flags(p.add_argument_group("parallelism"))
    _moe_flags(p.add_argument_group("mixture of experts"))
    _training_flags(p.add_argument_group("training"))
    _data_flags(p.add_argument_group("data"))
    _checkpoint_flags(p.add_argument_group("checkpointing and logging"))
    flags.add_flags(p.add_argument_group("tenplex"), flags.TRAINER)  # every --tenplex* flag: tenplex_megatron/flags.py
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    for flag in argv:
        name = flag.split("=", 1)[0]
        if name in MEGATRON_FLAGS_NOT_SUPPORTED:
            raise SystemExit(f"pretrain_gpt.py: error: Megatron-LM flag {name} is not supported by tenplex-megatron: "
                             f"{MEGATRON_FLAGS_NOT_SUPPORTED[name]}")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unknown or unsupported flag(s): {' '.join(unknown)}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    check_model_flags(parser, args, argv)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        parser.error("--overlap-param-gather needs --use-distributed-optimizer")
    if args.ddp_bucket_size is not None and (args.ddp_bucket_size < 1 or not args.overlap_grad_reduce):
        parser.error(f"--ddp-bucket-size {args.ddp_bucket_size}: needs --overlap-grad-reduce and a size >= 1")
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 exclude each other: give one")
    if args.data_path is not None and not args.data_path:
        parser.error("--data-path needs at least one dataset prefix")
    if bool(args.mock_data) == bool(args.data_path):
        parser.error("give exactly one of --mock-data or --data-path")
    # A text tokenizer (byte-level, GPT-2 BPE, Hugging Face) sets the vocabulary: --data-path always uses one
    # (NullTokenizer there means byte-level, as before), --mock-data when --tokenizer-type names one.
    file_flags = {"--vocab-file": args.vocab_file, "--merge-file": args.merge_file,
                  "--tokenizer-model": args.tokenizer_model}
    args.tokenizer = None
    if args.tokenizer_type == "NullTokenizer" and any(file_flags.values()):
        given = " and ".join(f for f, v in file_flags.items() if v)
        parser.error(f"{given} does not apply to --tokenizer-type NullTokenizer (give GPT2BPETokenizer or "
                     "HuggingFaceTokenizer)")
    if args.data_path or args.tokenizer_type != "NullTokenizer":
        ttype = "ByteLevel" if args.tokenizer_type == "NullTokenizer" else args.tokenizer_type
        try:
            args.tokenizer = build_tokenizer(TokenizerSpec.from_flags(
                ttype, args.vocab_file, args.merge_file, args.tokenizer_model, args.tokenizer_hf_include_special_tokens))
        except TokenizerError as e:
            parser.error(str(e))
        if args.vocab_size not in (None, args.tokenizer.vocab_size):
            parser.error(f"--vocab-size {args.vocab_size} does not match the tokenizer's vocabulary of "
                         f"{args.tokenizer.vocab_size} ({describe(args.tokenizer)}): leave it out")
        args.vocab_size = args.tokenizer.vocab_size
    if args.data_path:
        try:
            check_data_path(args.data_path, args.tokenizer)  # on every rank, before torch.distributed starts
        except ValueError as e:
            parser.error(str(e))
    if args.vocab_size is None:
        parser.error("--vocab-size is required with --mock-data")
    problem = memory_flags.check_memory_args(args)
    if problem:
        parser.error(problem)
    check_ckpt_flags(parser, args, argv)
    if problem := slurm.start_problem(os.environ, args, layout_choice.choose_for):  # the allocation disagrees
        raise SystemExit(f"{PROG}: error: {problem}")
    chosen = layout_choice.apply(args)  # before any process group: an impossible world size fails here
    if chosen is not None:
        args.tenplex_layout_why = chosen.why
    if args.micro_batch_size is None:
        parser.error("--micro-batch-size is required (or let --tenplex-layout choose it)")
    args.tensor_model_parallel_size = args.tensor_model_parallel_size or 1
    args.pipeline_model_parallel_size = args.pipeline_model_parallel_size or 1
    args.expert_model_parallel_size = args.expert_model_parallel_size or 1
    if args.tensor_model_parallel_size == 1:  # Megatron-LM's rule: a restart at TP 1 keeps its command line
        args.sequence_parallel = False
    args.virtual_pipeline_model_parallel_size = pipeline_flags.virtual_stages(parser, args)
    args.pipeline_split = pipeline_flags.pipeline_split(parser, args)
    if args.group_query_attention and args.num_query_groups % args.tensor_model_parallel_size:
        parser.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide "
                     f"--num-query-groups {args.num_query_groups} (TP splits the key/value head groups)")
    return args


#: Megatron-LM's checkpoint flags the trainer takes with --tenplex only (plan/megatron_ckpt_flags.py)
CKPT_FLAGS_NEED_TENPLEX = ("--ckpt-step", "--finetune", "--pretrained-checkpoint", "--no-load-optim", "--no-load-rng",
                      "--no-save-optim", "--no-save-rng", "--save-retain-interval", "--most-recent-k")


def check_ckpt_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Megatron-LM's checkpoint flags, before any process group: with --tenplex only, and checked against the
    table and ``--load`` (a ``--ckpt-step`` not there lists the steps there)."""
    given = sorted({a.split("=", 1)[0] for a in argv} & set(CKPT_FLAGS_NEED_TENPLEX))
    if given and not args.tenplex:
        parser.error(f"{', '.join(given)} needs --tenplex")
    if args.tenplex:
        problems = ckpt_flags.start_problems(args)
        if problems:
            parser.error("; ".join(problems))


def check_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """The Llama-style flags' own rules (before any layout is chosen): errors name the flag."""
    given = {flag.split("=", 1)[0] for flag in argv}
    if args.group_query_attention:
        if args.num_query_groups < 1:
            parser.error(f"--num-query-groups {args.num_query_groups} must be >= 1")
        if args.num_attention_heads % args.num_query_groups:
            parser.error(f"--num-query-groups {args.num_query_groups} does not divide --num-attention-heads "
                         f"{args.num_attention_heads} (each key/value group serves a whole number of heads)")
    elif "--num-query-groups" in given:
        parser.error("--num-query-groups needs --group-query-attention (without it every head is its own group)")
    if args.position_embedding_type != "rope" and given & {"--rotary-base", "--rotary-percent"}:
        parser.error(f"{' and '.join(sorted(given & {'--rotary-base', '--rotary-percent'}))} needs "
                     "--position-embedding-type rope")
    if not 0.0 < args.rotary_percent <= 1.0:
        parser.error(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.rotary_base < 1:
        parser.error(f"--rotary-base {args.rotary_base} must be >= 1")
    if not args.norm_epsilon > 0.0:
        parser.error(f"--norm-epsilon {args.norm_epsilon} must be > 0")
    check_moe_flags(parser, args, given)


def check_moe_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """The mixture-of-experts flags' own rules, before any process group starts: errors name the flag."""
    if args.num_experts is None:
        moe = sorted(f for f in given if f.startswith("--moe-") or f in ("--expert-tensor-parallel-size",)
                     or (f == "--expert-model-parallel-size" and args.expert_model_parallel_size not in (None, 1)))
        if moe:
            parser.error(f"{', '.join(moe)} needs --num-experts (a mixture-of-experts model)")
        return
    if args.num_experts < 1:
        parser.error(f"--num-experts {args.num_experts} must be >= 1")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        parser.error(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}")
    if args.expert_model_parallel_size is not None and (
            args.expert_model_parallel_size < 1 or args.num_experts % args.expert_model_parallel_size):
        parser.error(f"--expert-model-parallel-size {args.expert_model_parallel_size} does not divide --num-experts "
                     f"{args.num_experts} (each EP rank holds whole experts)")
    if args.expert_tensor_parallel_size is not None and args.expert_tensor_parallel_size < 1:
        parser.error(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} must be >= 1")
    if args.moe_grouped_gemm and not (args.bf16 and not args.add_bias_linear):
        missing = " and ".join(f for f, ok in (("--bf16", args.bf16), ("--disable-bias-linear",
                                                                        not args.add_bias_linear)) if not ok)
        parser.error(f"--moe-grouped-gemm needs {missing}: megatron-core's GroupedMLP runs the grouped GEMM in bf16 "
                     "only and has no biases")


def spec_from_args(args: argparse.Namespace) -> GPTSpec:
    """The model and optimizer flags as a :class:`GPTSpec`: each field is the flag of the same name (Megatron-LM's),
    so a new field needs only its flag."""
    return GPTSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GPTSpec)})


def main(argv: list[str] | None = None) -> int:
    orphan.die_with_agent()  # a worker whose torchrun agent dies exits at once (no save, no commit)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(REFORM_ENV):  # re-formed in place on plan (the launcher's --reform/--join)
        return reform.main(argv, args, build_parser(), parse_args, run)
    if args.tenplex_inprocess:  # in place under NVRx: re-entered after a fault (training/inprocess.py)
        return inprocess.main(argv, args, build_parser(), parse_args, run)
    ckpt = Checkpointer(JobConfig.from_args(args, PROG))  # before any process group: another job's directory refused
    gpt.init_distributed()
    args.tenplex_timeline = {"process_start": psutil.Process().create_time(), "process_group": time.time()}
    with ckpt.fenced():  # a newer generation (or a job that took over) writes
        run(args, ckpt)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def run(args: argparse.Namespace, ckpt: Checkpointer | None = None) -> None:
    """Collective: one job from parsed flags in an initialised process group: load, train, save, log; ``ckpt``: the
    job's Checkpointer (built here from the flags, the leases claimed, when not given), closed at the end.

    Builds megatron-core's parallel state afresh, so one process group can run
    several jobs in turn (the multi-process tests share launches this way)."""
    ckpt = Checkpointer(JobConfig.from_args(args, PROG)) if ckpt is None else ckpt
    layout = layout_from_args(args)
    spec = spec_from_args(args)
    found = checkpoints.sources(ckpt)  # the --tenplex-memory tier opened first
    padded = checkpoints.padded_vocab(args, spec, layout, found)
    checkpoints.check_hf_start(args, spec, found)
    job = _build_job(args, spec, layout, padded)
    job.trust_pickles = bool(args.tenplex_trust_pickles)
    if getattr(args, "tenplex_timeline", None) is not None:  # parallel state, model and optimizer built: the load next
        args.tenplex_timeline["built"] = time.time()
    checkpoints.restore(args, job, ckpt)
    _train(args, job, ckpt, _train_dataset(args, spec))
    # over: training is, and its last state goes to --save
    ckpt.finish(over=bool(args.save) and job.iteration >= args.train_iters, say=print_tenplex)
    if getattr(args, "tenplex_boundary", None) is None:  # re-formed on plan: the runner closes it after the world's
        ckpt.close()  # last barrier (a node that leaves waits on its helper then, not the ranks that stay)
    _print0("> tenplex-megatron: done")


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    """Collective with ``--tenplex-layout measure`` (which times candidates first): the job's layout at this world
    size, a world size the flags' parallel sizes do not divide refused naming them."""
    world = torch.distributed.get_world_size()
    if args.tenplex_layout == "measure":  # time the best few candidates once per world size, then choose
        measure.measure_and_choose(args, spec_from_args(args))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise SystemExit(
            f"pretrain_gpt.py: error: world size {world} is not divisible by "
            f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {tp} x {pp}"
        )
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    if world % (etp * ep * pp):
        raise SystemExit(
            f"pretrain_gpt.py: error: world size {world} is not divisible by --expert-tensor-parallel-size x "
            f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp} x {ep} x {pp}"
        )
    return ParallelLayout(tp, pp, world // (tp * pp), vpp=args.virtual_pipeline_model_parallel_size,
                          sp=bool(args.sequence_parallel and tp > 1), ep=ep, etp=etp,
                          split=getattr(args, "pipeline_split", ()))


def _build_job(args: argparse.Namespace, spec: GPTSpec, layout: ParallelLayout, padded: int) -> gpt.GPTJob:
    """Collective: the megatron-core job at ``layout`` (a bad combination of flags exits naming it), announced."""
    try:
        job = gpt.build_job(
            spec,
            layout,
            use_distributed_optimizer=args.use_distributed_optimizer,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            padded_vocab=padded,
            ddp=gpt.DDPOptions(overlap_grad_reduce=args.overlap_grad_reduce,
                               overlap_param_gather=args.overlap_param_gather, bucket_size=args.ddp_bucket_size),
        )
    except ValueError as e:  # LayoutError included: the message names the flag or constraint
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None
    if getattr(args, "tenplex_layout_why", None):
        _print0(f"> tenplex-megatron: --tenplex-layout {args.tenplex_layout}: "
                f"{describe_layout(layout, args.micro_batch_size, bool(spec.num_experts))} ({args.tenplex_layout_why})")
    _print0(f"> tenplex-megatron: layout {layout} (world {torch.distributed.get_world_size()}), "
            f"{job.num_microbatches} micro-batches per step, padded vocabulary {padded}")
    _print0(f" > padded vocab (size: {spec.vocab_size}) with {padded - spec.vocab_size} dummy tokens "
            f"(new size: {padded})")
    return job


def _train_dataset(args: argparse.Namespace, spec: GPTSpec) -> Any:
    """Collective: megatron-core's GPTDataset of ``--data-path``, built once on every rank (rank 0 first) and read by
    global index; None with ``--mock-data``."""
    if not args.data_path:
        return None
    t0 = time.perf_counter()
    try:
        dataset = build_train_dataset(args.data_path, args.split, spec.seq_length, spec.seed,
                                      args.train_iters * args.global_batch_size, args.tokenizer)
    except ValueError as e:
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None
    _print0(f"> tenplex-megatron: --data-path {' '.join(args.data_path)}: GPTDataset train split, "
            f"{len(dataset)} samples of {spec.seq_length} tokens (tokenizer {describe(args.tokenizer)}), "
            f"built in {time.perf_counter() - t0:.2f} s")
    return dataset


def _train(args: argparse.Namespace, job: gpt.GPTJob, ckpt: Checkpointer, dataset: Any) -> None:
    """Collective: train to ``--train-iters`` (or ``--exit-interval``), saving every ``--save-interval`` and at the
    end; with ``--tenplex``, SIGTERM (a scheduler's notice, torchrun's agent restarting for a node that joined or
    left) makes every rank stop after the same iteration, save and return."""
    stop = args.train_iters if args.exit_interval is None else min(args.train_iters, args.exit_interval)
    dp_rank = parallel_state.get_data_parallel_rank()
    on_signal = args.tenplex and not args.tenplex_no_save_on_signal
    # a re-formed rank whose launcher turns SIGTERM into its leave notice records none, but agrees with those that do
    heeded = () if os.environ.get(LEAVES_ENV) else (signal.SIGTERM,)
    with _metrics_file(args) as metrics, (StopOnSignal(heeded) if on_signal else contextlib.nullcontext()) as stopper:
        while job.iteration < stop:
            t0 = time.perf_counter()
            start, skipped = job.consumed_samples, job.skipped_iterations
            loss = gpt.train_step(job, _microbatches(args, job, dataset, start, dp_rank))
            _note_first_iteration(args)
            _log_iteration(args, job, loss, (time.perf_counter() - t0) * 1000)
            if metrics is not None:  # skipped: the fp16 loss scaler skipped this step
                _write_metrics(metrics, job, start, loss, skipped=job.skipped_iterations > skipped)
            if args.save and args.save_interval and job.iteration % args.save_interval == 0:
                checkpoints.save(job, args, ckpt)
            if stopper is not None and stopper.agreed():
                _print0(f"> tenplex: {stopper.name} received: stopping after iteration {job.iteration}"
                        + ("" if args.save else " (no --save: nothing is saved)"))
                break
            if getattr(args, "tenplex_boundary", None) is not None and args.tenplex_boundary():
                _print0(f"> tenplex: the world changes: re-forming after iteration {job.iteration}")
                break
        # still under the handler: the notice's second SIGTERM (torchrun's agent forwards the scheduler's) is recorded
        if args.save and (args.save_interval is None or job.iteration % args.save_interval != 0):
            checkpoints.save(job, args, ckpt)


def _metrics_file(args: argparse.Namespace) -> contextlib.AbstractContextManager[TextIO | None]:
    """``--tenplex-metrics``'s file, appended to on rank 0 (None elsewhere and without the flag)."""
    if args.tenplex_metrics and torch.distributed.get_rank() == 0:
        return open(args.tenplex_metrics, "a")
    return contextlib.nullcontext()


def _microbatches(args: argparse.Namespace, job: gpt.GPTJob, dataset: Any, start: int, dp_rank: int) -> Any:
    """This DP rank's micro-batches of the global batch that starts at sample ``start``."""
    if dataset is not None:
        return microbatches_from_dataset(dataset, start, job.global_batch_size, job.micro_batch_size,
                                         job.layout.dp, dp_rank)
    return microbatches(start, job.global_batch_size, job.micro_batch_size, job.layout.dp, dp_rank,
                        job.spec.seq_length, job.spec.vocab_size, job.spec.seed)


def _note_first_iteration(args: argparse.Namespace) -> None:
    """At a (re)start's first iteration: when it ended, and the whole timeline printed (where the time went)."""
    timeline = getattr(args, "tenplex_timeline", None)
    if timeline is not None and "first_iteration" not in timeline:
        timeline["first_iteration"] = time.time()
        _print0(f"> tenplex-megatron: timeline {json.dumps(timeline)}")


def _log_iteration(args: argparse.Namespace, job: gpt.GPTJob, loss: float, ms: float) -> None:
    """Megatron-LM's iteration line, every ``--log-interval`` iterations."""
    if job.iteration % args.log_interval == 0:
        _print0(
            f" iteration {job.iteration:8d}/{args.train_iters:8d} | consumed samples: {job.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | learning rate: {job.optimizer.param_groups[0]['lr']:.6E} |"
            f" global batch size: {job.global_batch_size:5d} | lm loss: {loss:.6E} |"
            f" number of skipped iterations: {job.skipped_iterations:3d} | number of nan iterations:   0 |"
        )


def _write_metrics(metrics: TextIO, job: gpt.GPTJob, start: int, loss: float, *, skipped: bool) -> None:
    """One ``--tenplex-metrics`` JSON line: the step's loss, LR, the global sample indices it trained on, layout."""
    dp = job.layout.dp
    samples = [
        i
        for r in range(dp)
        for mb in microbatch_sample_indices(start, job.global_batch_size, job.micro_batch_size, dp, r)
        for i in mb
    ]
    metrics.write(json.dumps({"iteration": job.iteration, "loss": loss, "lr": job.optimizer.param_groups[0]["lr"],
                              "samples": samples, "skipped": skipped, "loss_scale": _loss_scale(job),
                              "layout": job.layout.to_json(), "micro_batch_size": job.micro_batch_size,
                              "time": time.time()}) + "\n")
    metrics.flush()


def _loss_scale(job: Any) -> float | None:
    """The fp16 loss scaler's current scale (None without one)."""
    scaler = next((o.grad_scaler for o in sub_optimizers(job.optimizer) if getattr(o, "grad_scaler", None)), None)
    return float(scaler.scale.item()) if scaler is not None else None


def load_metrics(path: str) -> list[dict[str, Any]]:
    """Read the JSON lines written by ``--tenplex-metrics``."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":  # torchrun -m tenplex_megatron.training.pretrain (megatron's spawned manager needs the guard)
    sys.exit(main())
