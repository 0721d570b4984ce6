"""The reference trainer's pipeline flags: the interleaving (VPP) and Megatron-LM's uneven split
(``--decoder-first/last-pipeline-num-layers``, the account-for flags, ``--pipeline-model-parallel-layout``), checked
before any process group (``plan/pipeline_split.py`` has the rules)."""

from __future__ import annotations

import argparse

from tenplex_megatron.plan.pipeline_split import SplitError, SplitRule, even, layout_stages


def add_split_flags(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's uneven pipeline flags."""
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline: layers on the first pipeline rank (the rest evenly over the others)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline: layers on the last pipeline rank")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="uneven pipeline: count the embedding as a layer of the first stage")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="uneven pipeline: count the loss as a layer of the last stage")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="uneven pipeline: Megatron-LM's layout string, e.g. 'Ettt|tL' (sets VPP)")


def split_rule(args: argparse.Namespace) -> SplitRule:
    """Megatron-LM's uneven pipeline flags as given."""
    return SplitRule(first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
                     embedding=args.account_for_embedding_in_pipeline_split,
                     loss=args.account_for_loss_in_pipeline_split, layout=args.pipeline_model_parallel_layout)


def pipeline_split(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, ...]:
    """Each model chunk's layers from the uneven pipeline flags at this PP x VPP (empty: even), before any process
    group: a split that does not fit names the flags and the numbers."""
    rule = split_rule(args)
    if not rule.given:
        return ()
    try:
        return even(rule.counts(args.num_layers, args.pipeline_model_parallel_size,
                                args.virtual_pipeline_model_parallel_size))
    except SplitError as e:
        parser.error(str(e))


def virtual_stages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """VPP from Megatron-LM's two interleaving flags (at most one) or its layout string, checked against PP and the
    layers (an uneven split's own rules: :func:`pipeline_split`)."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp, uneven = args.pipeline_model_parallel_size, split_rule(args).given
    if args.pipeline_model_parallel_layout:
        stages = layout_stages(args.pipeline_model_parallel_layout)
        if per_stage is not None or per_rank not in (None, stages // pp):  # a chosen VPP the layout has: the same
            parser.error("--pipeline-model-parallel-layout sets VPP itself: leave out the interleaving flags")
        if stages % pp:
            parser.error(f"--pipeline-model-parallel-layout has {stages} stages: --pipeline-model-parallel-size "
                         f"{pp} must divide them")
        return stages // pp
    if uneven and per_stage is not None:
        parser.error("with an uneven pipeline give the interleaving as --num-virtual-stages-per-pipeline-rank "
                     "(Megatron-LM's rule)")
    if uneven and per_rank is not None:
        if pp < 2 or per_rank < 1:
            parser.error(f"--num-virtual-stages-per-pipeline-rank {per_rank} needs --pipeline-model-parallel-size "
                         f">= 2 (here {pp})")
        return per_rank
    if per_stage is None and per_rank is None:
        return 1
    if per_stage is not None and per_rank is not None:
        parser.error("give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank")
    pp = args.pipeline_model_parallel_size
    flag, value = (("--num-layers-per-virtual-pipeline-stage", per_stage) if per_stage is not None
                   else ("--num-virtual-stages-per-pipeline-rank", per_rank))
    if pp < 2:
        parser.error(f"{flag} needs --pipeline-model-parallel-size >= 2 (here {pp}): interleaving splits each "
                     "pipeline rank's layers into several model chunks")
    if value < 1 or args.num_layers % (pp * value):
        parser.error(f"{flag} {value}: PP x it = {pp} x {value} must divide --num-layers {args.num_layers}")
    return per_rank if per_stage is None else args.num_layers // (pp * per_stage)


