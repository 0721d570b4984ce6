"""ParallelLayout: parsing, the constraints a layout must meet (named in the error), vocab padding, rank order."""

from __future__ import annotations

import itertools

import pytest

from tenplex_megatron.plan.layout import (
    LayoutError,
    ModelShape,
    ParallelLayout,
    padded_vocab_size,
    restart_padded_vocab_size,
)

SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("tp=2,pp=2,dp=1", ParallelLayout(2, 2, 1)),
        ("tp=8", ParallelLayout(8, 1, 1)),
        ("pp=4,dp=3", ParallelLayout(1, 4, 3)),
        ("dp=2,tp=4", ParallelLayout(4, 1, 2)),
        (" TP = 2 , PP=3 ", ParallelLayout(2, 3, 1)),
        ("tp=2,,dp=2,", ParallelLayout(2, 1, 2)),
        ("", ParallelLayout(1, 1, 1)),
    ],
)
def test_parse_good(text: str, expected: ParallelLayout) -> None:
    got = ParallelLayout.parse(text)
    assert got == expected
    assert ParallelLayout.parse(str(got)) == got  # str() round-trips
    assert ParallelLayout.from_json(got.to_json()) == got


@pytest.mark.parametrize(
    "text,needles",
    [
        ("tp=two", ["'tp=two'", "'two'", "not an integer"]),
        ("tp=2.5", ["'2.5'", "not an integer"]),
        ("mp=2", ["'mp=2'", "expected e.g. tp=2,pp=2,dp=1"]),
        ("tp2", ["'tp2'", "expected e.g."]),
        ("tp=0", ["tp=0", ">= 1"]),
        ("dp=-1", ["dp=-1", ">= 1"]),
        ("pp=", ["'pp='", "not an integer"]),
    ],
)
def test_parse_bad_names_the_problem(text: str, needles: list[str]) -> None:
    with pytest.raises(LayoutError) as e:
        ParallelLayout.parse(text)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_layout_error_is_a_value_error() -> None:
    assert issubclass(LayoutError, ValueError)
    with pytest.raises(ValueError):
        ParallelLayout(tp=0)


@pytest.mark.parametrize(
    "layout,world,needles,absent",
    [
        (ParallelLayout(3, 1, 1), None, ["TP=3 does not divide the number of attention heads (8)"], ["layers", "world size"]),
        (ParallelLayout(16, 1, 1), None, ["TP=16", "attention heads (8)"], ["layers"]),
        (ParallelLayout(1, 3, 1), None, ["PP=3 does not divide the number of layers (4)"], ["attention heads", "world size"]),
        (ParallelLayout(2, 2, 1), 8, ["world size 8 != TP x PP x DP = 2 x 2 x 1 = 4"], ["attention heads", "layers"]),
        # every broken constraint is named, not just the first
        (ParallelLayout(3, 3, 1), 4, ["attention heads", "layers", "world size 4"], []),
    ],
)
def test_check_fits_names_the_broken_constraint(layout, world, needles, absent) -> None:
    with pytest.raises(LayoutError) as e:
        layout.check_fits(SHAPE, world_size=world)
    msg = str(e.value)
    assert str(layout) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    for word in absent:
        assert word not in msg, (word, msg)


def test_check_fits_hidden_size() -> None:
    shape = ModelShape(num_layers=2, hidden_size=12, num_attention_heads=8, vocab_size=10)
    with pytest.raises(LayoutError, match=r"hidden size \(12\)"):
        ParallelLayout(8, 1, 1).check_fits(shape)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2), (8, 1, 1), (1, 4, 3), (4, 2, 1), (2, 1, 5)])
def test_good_layouts_fit(tp: int, pp: int, dp: int) -> None:
    layout = ParallelLayout(tp, pp, dp)
    layout.check_fits(SHAPE)
    layout.check_fits(SHAPE, world_size=tp * pp * dp)
    assert layout.world_size == tp * pp * dp


@pytest.mark.parametrize(
    "vocab,div,tp,padded",
    [
        (100, 16, 1, 112),
        (100, 16, 2, 128),
        (100, 16, 3, 144),
        (100, 16, 4, 128),
        (96, 16, 2, 96),
        (112, 16, 1, 112),
        (1, 1, 1, 1),
        (50257, 128, 1, 50304),
        (50257, 128, 8, 51200),
    ],
)
def test_padded_vocab_size(vocab: int, div: int, tp: int, padded: int) -> None:
    got = padded_vocab_size(vocab, div, tp)
    assert got == padded
    assert got >= vocab and got % (div * tp) == 0 and got - vocab < div * tp  # the *next* multiple


@pytest.mark.parametrize(
    "saved,tp,expected",
    [
        (128, 1, 128),  # tp1 keeps the saved (tp2) padding
        (128, 2, 128),
        (128, 4, 128),
        (112, 1, 112),
        (112, 2, 112),  # TP=2 divides 112: keep it
        (112, 3, 144),  # TP=3 does not divide 112: megatron's rule for TP=3
        (128, 3, 144),
        (None, 1, 112),
        (None, 2, 128),
        (96, 1, 112),  # a saved size smaller than the vocabulary is never kept
    ],
)
def test_restart_padded_vocab_size(saved, tp: int, expected: int) -> None:
    got = restart_padded_vocab_size(100, 16, tp, saved)
    assert got == expected
    assert got % tp == 0 and got >= 100


@pytest.mark.parametrize("tp,pp,dp", list(itertools.product([1, 2, 4], [1, 2, 3], [1, 2, 3])))
def test_rank_coords_follow_megatron_order(tp: int, pp: int, dp: int) -> None:
    layout = ParallelLayout(tp, pp, dp)
    seen = set()
    for rank in range(layout.world_size):
        tp_rank, pp_rank, dp_rank = layout.rank_coords(rank)
        assert 0 <= tp_rank < tp and 0 <= pp_rank < pp and 0 <= dp_rank < dp
        assert rank == tp_rank + tp * dp_rank + tp * dp * pp_rank
        seen.add((tp_rank, pp_rank, dp_rank))
    assert len(seen) == layout.world_size  # a bijection onto the grid


def test_rank_coords_table() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert [layout.rank_coords(r) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1),
        (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1),
    ]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("tp=2,pp=2,dp=1,vpp=2", ParallelLayout(2, 2, 1, vpp=2)),
        ("tp=2,sp", ParallelLayout(2, sp=True)),
        ("tp=4,pp=2,vpp=3,sp=1,dp=2", ParallelLayout(4, 2, 2, vpp=3, sp=True)),
    ],
)
def test_parse_vpp_and_sp(text: str, expected: ParallelLayout) -> None:
    assert ParallelLayout.parse(text) == expected
    assert ParallelLayout.parse(str(expected)) == expected


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"pp": 1, "vpp": 2}, "vpp=2 needs pp >= 2"), ({"tp": 1, "sp": True}, "sp (sequence parallelism) needs tp >= 2"),
     ({"pp": 2, "vpp": 0}, "vpp=0"), ({"tp": 2, "sp": "yes"}, "sp='yes'")],
)
def test_vpp_and_sp_constraints_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout(**kwargs)


def test_json_records_vpp_and_sp_only_when_set() -> None:
    """A layout without VPP or SP writes the record older checkpoints have (so the RNG policy still sees them as
    the same layout); the new fields round-trip when set."""
    assert ParallelLayout(2, 1, 1).to_json() == {"tp": 2, "pp": 1, "dp": 1}
    assert ParallelLayout.from_json({"tp": 2, "pp": 1, "dp": 1}) == ParallelLayout(2, 1, 1)
    full = ParallelLayout(2, 2, 1, vpp=2, sp=True)
    assert full.to_json() == {"tp": 2, "pp": 2, "dp": 1, "vpp": 2, "sp": True}
    assert ParallelLayout.from_json(full.to_json()) == full
    assert full.world_size == 4 and full.stages == 4


def test_check_fits_counts_virtual_stages() -> None:
    ParallelLayout(1, 2, 1, vpp=2).check_fits(SHAPE)  # 4 layers in 4 stages
    with pytest.raises(LayoutError, match=r"PP x VPP = 2 x 4 does not divide the number of layers \(4\)"):
        ParallelLayout(1, 2, 1, vpp=4).check_fits(SHAPE)


def test_layout_model_interleaves_layers_over_virtual_stages() -> None:
    """Pipeline rank r holds virtual stages r, r + PP, ...: with 8 layers at PP2 x VPP2, rank 0 holds layers 0-1
    and 4-5, rank 1 layers 2-3 and 6-7 (megatron-core's interleaved assignment)."""
    from tenplex_megatron.plan.ptc import TensorMeta
    from tenplex_megatron.plan.sim.sharding import local_param_boxes

    t = TensorMeta(key="decoder.layers.x", global_shape=(8, 4), dtype="float32", stage="layers")
    layers = {r: [boxes[0][0][0] for boxes in local_param_boxes(t, ParallelLayout(1, 2, 1, vpp=2), 0, r)]
              for r in (0, 1)}
    assert layers == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("dp=2,ep=2", ParallelLayout(1, 1, 2, ep=2)),
        ("tp=2,dp=2,ep=2,etp=1", ParallelLayout(2, 1, 2, ep=2, etp=1)),
        ("tp=2,dp=2,ep=2,etp=2", ParallelLayout(2, 1, 2, ep=2)),  # expert TP = TP is the default: one spelling
    ],
)
def test_parse_ep_and_etp(text: str, expected: ParallelLayout) -> None:
    got = ParallelLayout.parse(text)
    assert got == expected
    assert ParallelLayout.parse(str(got)) == got
    assert ParallelLayout.from_json(got.to_json()) == got


def test_dense_layout_json_unchanged() -> None:
    """A dense layout's record keeps the keys written before EP existed (so same-layout RNG restores match)."""
    assert ParallelLayout(2, 2, 1).to_json() == {"tp": 2, "pp": 2, "dp": 1}
    assert ParallelLayout(2, 1, 2, ep=2).to_json() == {"tp": 2, "pp": 1, "dp": 2, "ep": 2}


def test_expert_degrees() -> None:
    layout = ParallelLayout(2, 1, 4, ep=4, etp=1)
    assert (layout.expert_tp, layout.expert_dp) == (1, 2)
    assert ParallelLayout(2, 1, 2).expert_tp == 2


def test_expert_layout_constraints_named() -> None:
    with pytest.raises(LayoutError, match=r"expert TP x EP x PP = 1 x 4 x 1 = 4 does not divide the world size"):
        ParallelLayout(1, 1, 2, ep=4)
    moe = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100, num_experts=6,
                     moe_ffn_hidden_size=48)
    with pytest.raises(LayoutError, match=r"--expert-model-parallel-size 4 does not divide --num-experts 6"):
        ParallelLayout(1, 1, 4, ep=4).check_fits(moe)
    with pytest.raises(LayoutError, match=r"--expert-tensor-parallel-size 5 does not divide .* \(48\)"):
        ParallelLayout(1, 1, 5, etp=5).check_fits(moe)
    dense = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100)
    with pytest.raises(LayoutError, match=r"need a mixture-of-experts model"):
        ParallelLayout(1, 1, 2, ep=2).check_fits(dense)
    ParallelLayout(1, 1, 2, ep=2).check_fits(moe)
