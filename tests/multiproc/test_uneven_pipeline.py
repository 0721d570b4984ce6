"""Uneven pipeline stages across a restart: the oracle of test_reshard_matrix.py (train at A, save at step 3, resume
at B; losses equal the uninterrupted run at A, the re-saved tensors equal the saved ones element for element) with
Megatron-LM's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` on one side or both,
and the pure layout model (dry runs, ``plan``) placing every chunk where megatron-core did at the uneven split.

Three launches (``matrix_run.py``, jobs of one world size share a process group): the references at PP2 3/1 (4
layers), PP2 x VPP2 4/2 (6 layers: chunks 2/1/2/1), PP2 with the embedding counted as a layer (5 layers: 2/3) and
PP1; the resumes at PP2 even, PP2 1/3, PP2 x VPP2 by a layout string (chunks 0/2/1/1: the embedding alone), PP2 3/1
from PP1; and the resumes at PP1. The trainer builds megatron-core from the recorded split (``megatron_kwargs``: the
first/last counts, else the equivalent layout string) and checks each chunk's layers; Megatron-LM's own flags go to
megatron-core as given (tests/megatron_lm -k uneven). Slow (``make test-bench``).
"""

from __future__ import annotations

import json
import os

import pytest

from tenplex_megatron.plan.layout import ParallelLayout
from tests.harness import TINY_GPT, torchrun
from tests.multiproc.test_reshard_matrix import (
    LOSS_RTOL,
    MATRIX_RUN,
    SAVE_AT,
    TRAIN_ITERS,
    assert_layout_model_matches,
    assert_losses_continue,
    assert_tensors_equal,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

VOCAB = 96
BASE = [*TINY_GPT, "--vocab-size", str(VOCAB), "--swiglu", "--train-iters", str(TRAIN_ITERS),
        "--use-distributed-optimizer"]
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
#: name -> (layers, flags of the layout, the split tenplex records: ParallelLayout)
LAYOUTS = {
    "pp2-3-1": (4, ["--pipeline-model-parallel-size", "2", FIRST, "3"], ParallelLayout(1, 2, 1, split=(3, 1))),
    "pp2-1-3": (4, ["--pipeline-model-parallel-size", "2", LAST, "3"], ParallelLayout(1, 2, 1, split=(1, 3))),
    "pp2": (4, ["--pipeline-model-parallel-size", "2"], ParallelLayout(1, 2, 1)),
    "pp1": (4, [], ParallelLayout(1, 1, 1)),
    "vpp-4-2": (6, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2", FIRST, "4"],
                ParallelLayout(1, 2, 1, vpp=2, split=(2, 1, 2, 1))),
    "l6-pp1": (6, [], ParallelLayout(1, 1, 1)),
    # Megatron-LM's layout string: the embedding alone in the first chunk (no layer), PP2 x VPP2
    "pp2-layout": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|tt|t|tL"],
                   ParallelLayout(1, 2, 1, vpp=2, split=(0, 2, 1, 1))),
    # the embedding counted as a layer: (5 + 1) / 2 per rank, one fewer on the first
    "l5-acct": (5, ["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"],
                ParallelLayout(1, 2, 1, split=(2, 3))),
    "l5-pp1": (5, [], ParallelLayout(1, 1, 1)),
}
REFERENCES = ("pp2-3-1", "vpp-4-2", "pp1", "l5-acct")
#: resume name -> (source reference, destination layout)
RESUMES = {
    "pp2-3-1>pp2": ("pp2-3-1", "pp2"),
    "pp2-3-1>pp2-1-3": ("pp2-3-1", "pp2-1-3"),
    "pp1>pp2-3-1": ("pp1", "pp2-3-1"),
    "pp2-3-1>pp1": ("pp2-3-1", "pp1"),
    "vpp-4-2>l6-pp1": ("vpp-4-2", "l6-pp1"),
    "pp2-3-1>pp2-layout": ("pp2-3-1", "pp2-layout"),
    "l5-acct>l5-pp1": ("l5-acct", "l5-pp1"),
}


def _world(name: str) -> int:
    return LAYOUTS[name][2].world_size


def _flags(name: str) -> list[str]:
    layers, flags, _ = LAYOUTS[name]
    return [*BASE, "--num-layers", str(layers), *flags]


def _launch(root: str, key: str, world: int, tasks: list[list[str]]) -> None:
    path = os.path.join(root, f"{key}.json")
    with open(path, "w") as f:
        json.dump(tasks, f)
    r = torchrun(world, [path], timeout=240 + 60 * len(tasks), script=MATRIX_RUN)
    assert r.returncode == 0 and r.log.count("tenplex-megatron: done") == len(tasks), r.log[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every reference and resume, in three launches: world 2's references first (PP1's in the world-1 launch that
    also resumes at PP1 runs before them), then world 2's resumes."""
    root = str(tmp_path_factory.mktemp("uneven"))

    def ref(name: str) -> list[str]:
        d = os.path.join(root, f"ref-{name}")
        return [*_flags(name), "--save", f"{d}/ckpt", "--save-interval", str(SAVE_AT), "--tenplex-metrics",
                f"{d}/metrics.jsonl"]

    def resume(name: str) -> list[str]:
        src, dst = RESUMES[name]
        d = os.path.join(root, name)
        return [*_flags(dst), "--load", _ckpt(root, src), "--tenplex-resave", f"{d}/resave", "--tenplex-metrics",
                f"{d}/metrics.jsonl", "--exit-interval", str(TRAIN_ITERS)]

    _launch(root, "refs-w2", 2, [ref(n) for n in REFERENCES if _world(n) == 2])
    _launch(root, "w1", 1, [ref("pp1"), *(resume(n) for n, (_, dst) in RESUMES.items() if _world(dst) == 1)])
    _launch(root, "resumes-w2", 2, [resume(n) for n, (_, dst) in RESUMES.items() if _world(dst) == 2])
    return root


def _ckpt(root: str, ref: str) -> str:
    return os.path.join(root, f"ref-{ref}", "ckpt", f"iter_{SAVE_AT:07d}")


@pytest.mark.parametrize("name", list(RESUMES))
def test_uneven_restart_continues_the_loss_curve(runs: str, name: str) -> None:
    src, dst = RESUMES[name]
    d = os.path.join(runs, name)
    resaved = os.path.join(d, "resave", f"iter_{SAVE_AT:07d}")
    assert_losses_continue(os.path.join(runs, f"ref-{src}"), d, LOSS_RTOL)
    assert assert_tensors_equal(_ckpt(runs, src), resaved, VOCAB) > 0
    for ckpt, lay in ((_ckpt(runs, src), LAYOUTS[src][2]), (resaved, LAYOUTS[dst][2])):
        with open(os.path.join(ckpt, "metadata.json")) as f:
            assert ParallelLayout.from_json(json.load(f)["layout"]) == lay  # the split recorded (absent: even)
        assert_layout_model_matches(ckpt, lay, True)
