"""Crash safety: a crash at any point of a save loses nothing that was complete; damage is caught.

Faults are injected with TENPLEX_FAULT (tenplex_megatron/storage/faults.py) into
real 2-process jobs: SIGKILL of a rank while writing tensors, while writing the
metadata, just before the commit; ENOSPC on one rank; an error on one or every
rank at load. Every run is under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from tenplex_megatron.storage.directory import find_checkpoint, partial_dirs
from tests.harness import TINY_GPT, layout_flags, torchrun

pytestmark = pytest.mark.dist

MODEL = [*TINY_GPT, "--vocab-size", "96", "--use-distributed-optimizer", "--train-iters", "4", *layout_flags(1, 1)]


def run(args: list[str], fault: str | None = None, nproc: int = 2, timeout: float = 180):
    env_fault = {"TENPLEX_FAULT": fault} if fault else {}
    old = {k: os.environ.get(k) for k in env_fault}
    os.environ.update(env_fault)
    try:
        return torchrun(nproc, [*MODEL, *args], timeout=timeout)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shard_digests(ckpt_dir: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def clean_iter2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Shard digests of iteration 2 from a run without faults (training is deterministic on the CPU)."""
    d = tmp_path_factory.mktemp("clean")
    r = run(["--save", f"{d}/ckpt", "--exit-interval", "2"])
    assert r.returncode == 0, r.log[-3000:]
    return shard_digests(f"{d}/ckpt/iter_0000002")


@pytest.mark.parametrize("point", ["save.tensors@1#4", "save.metadata@0#4", "save.commit@0#4"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, clean_iter2, point: str) -> None:
    save = str(tmp_path / "ckpt")
    r = run(["--save", save, "--save-interval", "2"], fault=point)
    assert r.returncode != 0 and "tenplex-megatron: done" not in r.log
    assert find_checkpoint(save) == os.path.join(save, "iter_0000002")
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    assert partial_dirs(save) == [os.path.join(save, "iter_0000004.tenplex-partial")]
    assert shard_digests(os.path.join(save, "iter_0000002")) == clean_iter2
    # The previous checkpoint loads, training continues, and the next save cleans up the partial directory.
    r = run(["--save", save, "--load", save])
    assert r.returncode == 0, r.log[-3000:]
    assert "loaded iteration 2" in r.log and "rng restored exactly" in r.log
    assert f"removed {save}/iter_0000004.tenplex-partial" in r.log
    assert partial_dirs(save) == [] and find_checkpoint(save) == os.path.join(save, "iter_0000004")


def test_disk_full_on_one_rank_fails_cleanly_everywhere(tmp_path) -> None:
    save = str(tmp_path / "ckpt")
    r = run(["--save", save, "--save-interval", "2"], fault="save.tensors@1#4:enospc")
    assert r.returncode != 0 and "TIMEOUT" not in r.log
    assert f"save of iteration 4 to {save}: writing shards failed on 1 rank(s)" in r.log
    assert "rank 1: OSError: [Errno 28] No space left on device" in r.log
    assert find_checkpoint(save) == os.path.join(save, "iter_0000002")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("saved")
    r = run(["--save", f"{d}/ckpt", "--exit-interval", "2"])
    assert r.returncode == 0, r.log[-3000:]
    return f"{d}/ckpt"


@pytest.mark.parametrize("fault,failing", [("load.read@1:error", [1]), ("load.read:error", [0, 1])])
def test_load_errors_from_every_rank_reach_rank0(saved: str, fault: str, failing: list[int]) -> None:
    r = run(["--load", saved], fault=fault)
    assert r.returncode != 0 and "TIMEOUT" not in r.log
    assert f"planning failed on {len(failing)} rank(s)" in r.log
    rank0 = [line for line in r.log.splitlines() if line.startswith("[rank0]:")]
    for rank in failing:
        assert any(f"rank {rank}: RuntimeError: injected fault at load.read on rank {rank}" in line for line in rank0)


def test_flipped_byte_is_caught_naming_file_and_tensor(saved: str, tmp_path) -> None:
    bad = str(tmp_path / "ckpt")
    shutil.copytree(saved, bad)
    ckpt = os.path.join(bad, "iter_0000002")
    with open(os.path.join(ckpt, "metadata.json")) as f:
        chunk = next(c for c in json.load(f)["ptc"]["chunks"] if c["at"]["file"] == "rank_00001.safetensors")
    path = os.path.join(ckpt, "rank_00001.safetensors")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    header = int.from_bytes(data[:8], "little")
    with open(path, "rb") as f:
        f.seek(8)
        entry = json.loads(f.read(header))[chunk["at"]["name"]]
    pos = 8 + header + entry["data_offsets"][0] + 1
    data[pos] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)
    r = run(["--load", bad])
    assert r.returncode != 0
    assert "rank_00001.safetensors: tensor" in r.log and chunk["at"]["name"] in r.log and "fails its checksum" in r.log
    r = run(["--load", bad, "--tenplex-no-verify", "--exit-interval", "2"])
    assert r.returncode == 0, r.log[-3000:]


def test_retention_keeps_newest_n(tmp_path) -> None:
    save = str(tmp_path / "ckpt")
    r = run(["--save", save, "--save-interval", "1", "--tenplex-keep", "2"])
    assert r.returncode == 0, r.log[-3000:]
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert f"removed {save}/iter_0000002" in r.log
