"""Layout constraints (named in the error), Megatron's vocab padding, and which checkpoint directory is chosen."""

from __future__ import annotations

import json
import os

import pytest

from tenplex_megatron.plan.layout import (
    LayoutError,
    ModelShape,
    ParallelLayout,
    padded_vocab_size,
    restart_padded_vocab_size,
)
from tenplex_megatron.storage.layout import commit, find_checkpoint, partial_dirs, prepare_partial

SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=100)


@pytest.mark.parametrize(
    "layout,world,needle",
    [
        (ParallelLayout(3, 1, 1), None, "TP=3 does not divide the number of attention heads (8)"),
        (ParallelLayout(1, 3, 1), None, "PP=3 does not divide the number of layers (4)"),
        (ParallelLayout(2, 2, 1), 8, "world size 8 != TP x PP x DP = 2 x 2 x 1 = 4"),
    ],
)
def test_layout_that_cannot_hold_the_model_names_the_constraint(layout, world, needle) -> None:
    with pytest.raises(LayoutError, match=None) as e:
        layout.check_fits(SHAPE, world_size=world)
    assert needle in str(e.value)


def test_good_layouts_fit_and_parse() -> None:
    for text in ("tp=2,pp=2,dp=2", "tp=8", "pp=4,dp=3"):
        ParallelLayout.parse(text).check_fits(SHAPE)
    assert ParallelLayout.parse("tp=2,pp=2,dp=1") == ParallelLayout(2, 2, 1)
    with pytest.raises(LayoutError, match="not an integer"):
        ParallelLayout.parse("tp=two")
    with pytest.raises(LayoutError, match="expected e.g."):
        ParallelLayout.parse("mp=2")


@pytest.mark.parametrize("vocab,div,tp,padded", [(100, 16, 1, 112), (100, 16, 2, 128), (96, 16, 2, 96),
                                                 (50257, 128, 8, 51200), (50257, 128, 1, 50304)])
def test_megatron_vocab_padding(vocab, div, tp, padded) -> None:
    assert padded_vocab_size(vocab, div, tp) == padded


@pytest.mark.parametrize("saved,tp,expected", [(128, 1, 128), (112, 2, 112), (112, 3, 144), (None, 2, 128)])
def test_restart_keeps_padded_vocab_when_tp_divides_it(saved, tp, expected) -> None:
    assert restart_padded_vocab_size(100, 16, tp, saved) == expected


def test_rank_coords_follow_megatron_order() -> None:
    lay = ParallelLayout(2, 3, 2)
    for rank in range(lay.world_size):
        tp, pp, dp = lay.rank_coords(rank)
        assert rank == tp + lay.tp * dp + lay.tp * lay.dp * pp


def _meta(it: int) -> dict:
    return {"format": "tenplex-megatron", "format_version": 1, "iteration": it}


def test_incomplete_checkpoints_are_never_chosen(tmp_path) -> None:
    save = str(tmp_path)
    for it in (2, 4):
        prepare_partial(save, it)
        commit(save, it, _meta(it), {})
    assert find_checkpoint(save) == os.path.join(save, "iter_0000004")
    prepare_partial(save, 6)  # a save that never committed
    os.makedirs(os.path.join(save, "iter_0000008"))  # a directory without metadata (a rank never finished)
    assert find_checkpoint(save) == os.path.join(save, "iter_0000004")
    assert partial_dirs(save) == [os.path.join(save, "iter_0000006.tenplex-partial")]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("8")  # tracker pointing at an incomplete directory: fall back to the newest complete one
    assert find_checkpoint(save) == os.path.join(save, "iter_0000004")
    with open(os.path.join(save, "iter_0000008", "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)  # another format's metadata is not ours
    assert find_checkpoint(save) == os.path.join(save, "iter_0000004")


def test_commit_refuses_a_missing_rank_file(tmp_path) -> None:
    save = str(tmp_path)
    prepare_partial(save, 2)
    with pytest.raises(Exception, match="rank_00001.safetensors: a rank's shard file is missing"):
        commit(save, 2, _meta(2), {"rank_00001.safetensors": 10})
    assert find_checkpoint(save) is None
