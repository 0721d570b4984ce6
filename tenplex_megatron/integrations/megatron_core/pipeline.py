"""A megatron-core job's pipeline split, read from its ``TransformerConfig`` and checked against the layers its model
chunks hold: the uneven split (``--decoder-first/last-pipeline-num-layers``, the account-for flags,
``--pipeline-model-parallel-layout``) recorded in the layout, so that a restart re-shards by global layer."""

from __future__ import annotations

from typing import Any

from tenplex_megatron.integrations.megatron_core.sharded import ModelArgumentError, unwrap
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.pipeline_split import SplitError, SplitRule


def config_split(config: Any, pp: int, vpp: int) -> tuple[int, ...]:
    """Each model chunk's layer count as ``config`` splits them (empty: megatron-core's even split)."""
    if config is None or pp < 2:
        return ()
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None and not isinstance(layout, str):  # megatron-core's PipelineParallelLayerLayout
        return tuple(sum(1 for t in layout.layout[r][v] if getattr(t, "name", "") == "decoder")
                     for v in range(vpp) for r in range(pp))
    rule = SplitRule(first=getattr(config, "num_layers_in_first_pipeline_stage", None),
                     last=getattr(config, "num_layers_in_last_pipeline_stage", None),
                     embedding=bool(getattr(config, "account_for_embedding_in_pipeline_split", False)),
                     loss=bool(getattr(config, "account_for_loss_in_pipeline_split", False)),
                     layout=layout or None)
    if not rule.given:
        return ()
    try:
        return rule.counts(int(config.num_layers), pp, vpp)
    except SplitError as e:
        raise ModelArgumentError(f"tenplex: {e}") from None


def check_chunks(chunks: list[Any], layout: ParallelLayout, pp_rank: int) -> None:
    """Every model chunk holds the global layers ``layout`` gives it (megatron-core's numbering: ``layer_number``
    counts from 1), else :class:`ModelArgumentError` naming the chunk and both ranges."""
    for v, chunk in enumerate(chunks):
        decoder = getattr(unwrap(chunk), "decoder", None)
        config = getattr(unwrap(chunk), "config", None)
        layers = getattr(decoder, "layers", None)
        if layers is None or config is None:
            continue
        want = layout.layers(int(config.num_layers), pp_rank, v)
        got = [int(layer.layer_number) - 1 for layer in layers]
        if got != list(want):
            shown = f"{got[0]}..{got[-1]}" if got else "none"
            raise ModelArgumentError(f"tenplex: pipeline rank {pp_rank}'s model chunk {v} holds layers {shown}, the "
                                     f"layout {layout} gives it {want.start}..{want.stop - 1}")
