"""The uneven pipeline split (plan/pipeline_split.py) against megatron-core's own ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` (and its ``PipelineParallelLayerLayout``) as the oracle, over every small configuration:
where megatron-core builds a split covering the layers once, ours is the same chunk by chunk; where ours refuses,
megatron-core refuses or builds no such split; and the refusals name the flags and the numbers."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import pytest

from tenplex_megatron.plan.layout import LayoutError, ModelShape, ParallelLayout
from tenplex_megatron.plan.pipeline_split import SplitError, SplitRule, chunk_layers, layout_stages, megatron_kwargs

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def _config(rule: SplitRule, num_layers: int, pp: int, vpp: int) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
            use_cpu_initialization=True, num_layers_in_first_pipeline_stage=rule.first,
            num_layers_in_last_pipeline_stage=rule.last, account_for_embedding_in_pipeline_split=rule.embedding,
            account_for_loss_in_pipeline_split=rule.loss, pipeline_model_parallel_layout=rule.layout)


def megatron_counts(rule: SplitRule, num_layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """megatron-core's (offset, count) of every chunk in chunk order, as counts; None where megatron-core refuses
    or its chunks do not cover the layers once, in order."""
    try:
        config = _config(rule, num_layers, pp, vpp)
        spans = []
        for v, r in itertools.product(range(vpp), range(pp)):
            vp = v if vpp > 1 else None
            if rule.layout:  # megatron-core asks the process group for the rank here: the layout's own, by rank
                lay = config.pipeline_model_parallel_layout  # type: ignore[attr-defined]
                spans.append((lay.get_layer_offset(LayerType.decoder, vp, r),
                              lay.get_num_layers_to_build(LayerType.decoder, vp, r)))
            else:
                spans.append((get_transformer_layer_offset(config, vp, r), get_num_layers_to_build(config, vp, r)))
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    at = 0
    for offset, count in spans:
        if count < 0 or (count and offset != at):
            return None
        at += count
    return tuple(c for _, c in spans) if at == num_layers else None


def _rules(num_layers: int) -> Iterator[SplitRule]:
    counts = [None, *range(1, num_layers + 1)]
    for first, last in itertools.product(counts, counts):
        yield SplitRule(first=first, last=last)
    for embedding, loss in ((True, False), (False, True), (True, True), (False, False)):
        yield SplitRule(embedding=embedding, loss=loss)


@pytest.fixture
def vpp_world():
    """megatron-core's layout reads the virtual pipeline size from its parallel state (no process group needed)."""
    yield lambda vpp: parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _built(split: tuple[int, ...], num_layers: int, pp: int, vpp: int, vpp_world) -> tuple[int, ...] | None:
    """The chunks megatron-core builds from :func:`megatron_kwargs` of a split."""
    kwargs = megatron_kwargs(split if len(set(split)) > 1 else (), pp, vpp)
    vpp_world(vpp)
    rule = SplitRule(first=kwargs.get("num_layers_in_first_pipeline_stage"),
                     last=kwargs.get("num_layers_in_last_pipeline_stage"),
                     layout=kwargs.get("pipeline_model_parallel_layout"))
    return megatron_counts(rule, num_layers, pp, vpp)


def test_first_last_and_account_for_equal_megatron_core(vpp_world) -> None:
    agreed = refused = 0
    for num_layers, pp, vpp in itertools.product(range(1, 10), range(1, 5), (1, 2, 3)):
        if vpp > 1 and pp < 2:
            continue
        for rule in _rules(num_layers):
            want = megatron_counts(rule, num_layers, pp, vpp)
            try:
                got = rule.counts(num_layers, pp, vpp)
            except SplitError:
                got = None
            if got is None and pp == 1 and rule.first is not None and rule.last is not None:
                continue  # both flags name the one rank: megatron-core then takes the last's count; refused here
            assert got == want, (rule, num_layers, pp, vpp)
            agreed += got is not None
            refused += got is None
            if got is not None:  # the trainer builds megatron-core from the counts alone: the same chunks
                assert _built(got, num_layers, pp, vpp, vpp_world) == got, (rule, num_layers, pp, vpp)
    assert agreed > 100 and refused > 100  # both sides of the rule are exercised


LAYOUTS = ["Et|tL", "Ettt|tL", "E|tttt|L", "Et|tt|tt|tL", "Ett|t|t|ttL", "E(t|)*3tL", "Et*3|t*2L", "E,t|t,t|t|tL"]


@pytest.mark.parametrize("text", LAYOUTS)
def test_layout_string_equals_megatron_core(text: str, vpp_world) -> None:
    stages = layout_stages(text)
    num_layers = text.count("t")  # recounted below after unrolling
    tried = 0
    for pp in (p for p in range(1, stages + 1) if stages % p == 0):
        vpp = stages // pp
        if vpp > 1 and pp < 2:
            continue
        vpp_world(vpp)
        rule = SplitRule(layout=text)
        for num_layers in range(1, 12):
            want = megatron_counts(rule, num_layers, pp, vpp)
            try:
                got = rule.counts(num_layers, pp, vpp)
            except SplitError:
                got = None
            assert got == want, (text, num_layers, pp, vpp)
            tried += got is not None
    assert tried >= 1


@pytest.mark.parametrize("num_layers,pp,vpp,rule", [
    (5, 2, 1, SplitRule(first=3)), (7, 3, 1, SplitRule(first=1, last=2)), (8, 2, 2, SplitRule(last=2)),
    (6, 2, 1, SplitRule(embedding=True, loss=True)), (6, 2, 2, SplitRule(layout="Et|tt|tt|tL")),
])
def test_layout_chunks_follow_the_split(num_layers: int, pp: int, vpp: int, rule: SplitRule, vpp_world) -> None:
    """ParallelLayout.layers: every chunk's global layers are megatron-core's offset and count."""
    vpp_world(vpp)
    want = megatron_counts(rule, num_layers, pp, vpp)
    assert want is not None
    layout = ParallelLayout(1, pp, 1, vpp=vpp, split=rule.counts(num_layers, pp, vpp))
    got = [layout.layers(num_layers, r, v) for v in range(vpp) for r in range(pp)]
    assert tuple(len(g) for g in got) == want
    assert [x for g in got for x in g] == list(range(num_layers))
    layout.check_fits(ModelShape(num_layers, 8, 2, 100))
    assert ParallelLayout.from_json(layout.to_json()) == layout
    assert ParallelLayout.parse(str(layout)) == layout


def test_even_split_has_one_spelling_and_old_records_read_even() -> None:
    assert ParallelLayout(1, 2, 1, split=(2, 2)) == ParallelLayout(1, 2, 1)
    assert "split" not in ParallelLayout(1, 2, 1, split=(2, 2)).to_json()
    old = ParallelLayout.from_json({"tp": 1, "pp": 2, "dp": 1})
    assert old.split == () and list(old.layers(4, 1)) == [2, 3]
    assert list(chunk_layers((), 4, 2, 1, 1)) == [2, 3]


@pytest.mark.parametrize("call,needles", [
    (lambda: SplitRule(first=8).counts(8, 2), ["--decoder-first-pipeline-num-layers 8", "--num-layers 8", "PP 2",
                                               "0 layers are left for the 1 pipeline ranks"]),
    (lambda: SplitRule(first=1, last=1).counts(7, 4), ["--decoder-last-pipeline-num-layers 1", "5 layers left",
                                                       "2 pipeline ranks"]),
    (lambda: SplitRule(first=3).counts(7, 2, 2), ["VPP 2 does not divide --decoder-first-pipeline-num-layers 3"]),
    (lambda: SplitRule(embedding=True).counts(4, 2), ["PP 2 does not divide --num-layers 4",
                                                      "--account-for-embedding-in-pipeline-split", "5 counted"]),
    (lambda: SplitRule(layout="Et|tL").counts(2, 1), ["'Et|tL' has 2 stages", "PP x VPP = 1 x 1 = 1"]),
    (lambda: SplitRule(layout="Et|tm|L").counts(2, 3), ["multi-token-prediction"]),
    (lambda: ParallelLayout(1, 2, 1, split=(3, 1, 1)), ["split=3/1/1", "3 pipeline chunks", "PP x VPP = 2 x 1 = 2"]),
    (lambda: ParallelLayout(1, 2, 1, split=(3, 1)).check_fits(ModelShape(5, 8, 2, 100)),
     ["split 3/1 holds 4 layers, the model 5"]),
])
def test_bad_splits_name_flags_and_numbers(call, needles: list[str]) -> None:
    with pytest.raises((SplitError, LayoutError)) as e:
        call()
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
