"""Crash safety: a crash at any point of a save loses nothing that was complete; damage is caught.

Faults are injected with TENPLEX_FAULT (tenplex_megatron/storage/faults.py) into
real 2-process jobs: SIGKILL of a rank while writing tensors, while writing the
metadata, just before the commit; ENOSPC on one rank; an error on one or every
rank at load. Every run is under a timeout, so a hang fails the test.

Five torchrun launches in all: each SIGKILL kills its own launch; every other job
(the clean save, retention, ENOSPC; then the resumes after the kills, the load
errors, the flipped byte) runs in one of two shared launches
(tests/multiproc/scenario_run.py: one process group, jobs in turn, each job's
exit status and output recorded as its own launch would have given them).

Transformer Engine's ``_extra_state`` rides along the two shared launches (TE itself needs a GPU: megatron-core's
linear layers carry its kind of extra state, tests/fake_te.py): saved per rank at TP2, restored byte for byte at
TP2, dropped with one warning at TP1 x DP2, the losses continuing the uninterrupted run's either way; a flipped
byte in it is refused at load. The same through host memory (``--tenplex-memory``): a TP2 job snapshots iteration 3
into node memory (persisted to --save in the background) and stops; restarts from the snapshot get the bytes back
exactly at TP2 and drop them with one warning at TP1 x DP2; a snapshot whose rank-local entry has a flipped byte is
skipped as damaged, that rank file read from the persisted durable copy instead, the bytes again exact.
Megatron-LM's checkpoint flags ride the shared launches too: retention by --save-retain-interval and
--most-recent-k beside --tenplex-keep; weights-only checkpoints (--no-save-optim --no-save-rng) refused by a load
that wants the optimizer and loaded with --no-load-optim; a --ckpt-step that is not there; --pretrained-checkpoint
with an empty --load; --exit-on-missing-checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from tenplex_megatron.storage.directory import committed_iterations, find_checkpoint, partial_dirs
from tests.harness import TINY_GPT, Run, layout_flags, metrics, read_full_tensors, run_scenarios, torchrun

pytestmark = pytest.mark.dist

TE_MODEL = [*TINY_GPT, "--vocab-size", "96", "--use-distributed-optimizer", "--train-iters", "6"]
TE_SAVE_AT = 3
MODEL = [*TINY_GPT, "--vocab-size", "96", "--use-distributed-optimizer", "--train-iters", "4", *layout_flags(1, 1)]
RETAIN_ITERS = 6
RETAIN_FLAGS = ["--save-retain-interval", "3", "--most-recent-k", "2", "--tenplex-keep", "4"]
KILL_POINTS = ["save.tensors@1#4", "save.metadata@0#4", "save.commit@0#4"]
LOAD_FAULTS = [("load.read@1:error", [1]), ("load.read:error", [0, 1])]


def run(args: list[str], fault: str | None = None, nproc: int = 2, timeout: float = 180):
    with mock.patch.dict(os.environ, {"TENPLEX_FAULT": fault} if fault else {}):
        return torchrun(nproc, [*MODEL, *args], timeout=timeout)


def job(name: str, args: list[str], fault: str | None = None) -> dict:
    return {"name": name, "flags": [*MODEL, *args], "fault": fault}


TE_RESTARTS = {"same": 2, "tp1": 1}  # restart tag -> TP (world 2: TP2 is the saving layout, TP1 x DP2 another)
# restarts from host memory: tag -> (TP, memory directory)
TE_MEM_RESTARTS = {"mem_same": (2, "mem"), "mem_tp1": (1, "mem"), "mem_flipped": (2, "mem_flipped")}


def te_job(name: str, args: list[str]) -> dict:
    """A job whose transformer layers' linears carry Transformer Engine's kind of _extra_state (tests/fake_te.py)."""
    return {"name": name, "flags": [*TE_MODEL, *args], "fake_te": True}


def rank_local_bytes(ckpt: str) -> dict[tuple[str, str], bytes]:
    """(rank, entry) -> the bytes of every rank-local entry metadata.json lists, read with safetensors' own reader."""
    from safetensors import safe_open

    with open(os.path.join(ckpt, "metadata.json")) as f:
        section = json.load(f).get("rank_local") or {}
    out = {}
    for r, s in section.items():
        with safe_open(os.path.join(ckpt, s["file"]), "pt") as f:
            for name in s["entries"]:
                out[(r, name)] = f.get_tensor(name).numpy().tobytes()
    return out


def flip_rank_local_byte(ckpt: str) -> str:
    """Flip one bit in rank 1's first rank-local entry; return the entry's name."""
    with open(os.path.join(ckpt, "metadata.json")) as f:
        section = json.load(f)["rank_local"]["1"]
    name = sorted(section["entries"])[0]
    path = os.path.join(ckpt, section["file"])
    with open(path, "rb") as f:
        data = bytearray(f.read())
    header = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8 : 8 + header])[name]
    data[8 + header + entry["data_offsets"][0] + 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(data)
    return name


def shard_digests(ckpt_dir: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def flip_a_byte(ckpt: str) -> str:
    """Flip one bit inside the data of a tensor stored in rank_00001.safetensors; return the tensor's name."""
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
    return chunk["at"]["name"]


@dataclass(frozen=True)
class AfterKill:
    """A SIGKILL launch and the state of its save directory right after it (before the resume touched it)."""

    save: str
    killed: Run
    newest: str | None
    has_iter4: bool
    partials: list[str]
    iter2_digests: dict[str, str]


@dataclass(frozen=True)
class Results:
    root: str
    clean_iter2: dict[str, str]  # shard digests of iteration 2 from a run without faults (deterministic on the CPU)
    saved: str
    first: dict[str, Run]
    kills: dict[str, AfterKill]
    second: dict[str, Run]
    flipped_name: str
    te_flipped: str  # the rank-local entry whose byte was flipped
    te_mem_flipped: str  # the same in the host-memory snapshot's copy
    te_mem_saved: dict[tuple[str, str], bytes]  # the rank-local entries of the snapshot in node memory
    te_mem_persisted: dict[tuple[str, str], bytes]  # and of its durable copy, persisted in the background


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    root = str(tmp_path_factory.mktemp("crash"))
    saved = f"{root}/saved/ckpt"
    first = run_scenarios(2, [
        job("clean", ["--save", saved, "--exit-interval", "2"]),
        job("retention", ["--save", f"{root}/retention", "--save-interval", "1", "--tenplex-keep", "2"]),
        job("retain_interval", ["--save", f"{root}/retain_interval", "--save-interval", "1", "--train-iters",
                                str(RETAIN_ITERS), *RETAIN_FLAGS]),
        job("weights_only", ["--save", f"{root}/weights_only", "--save-interval", "2", "--no-save-optim",
                             "--no-save-rng"]),
        job("disk_full", ["--save", f"{root}/disk_full", "--save-interval", "2"], "save.tensors@1#4:enospc"),
        te_job("te_ref", [*layout_flags(2, 1), "--save", f"{root}/te/ckpt", "--save-interval", str(TE_SAVE_AT),
                          "--tenplex-metrics", f"{root}/te/ref.jsonl"]),
        te_job("te_mem", [*layout_flags(2, 1), "--save", f"{root}/te/mem_ckpt", "--save-interval", str(TE_SAVE_AT),
                          "--exit-interval", str(TE_SAVE_AT), "--tenplex-memory", f"{root}/te/mem",
                          "--tenplex-replicas", "1"]),
    ], f"{root}/first")
    assert first["clean"].returncode == 0, first["clean"].log[-3000:]
    clean_iter2 = shard_digests(f"{saved}/iter_0000002")
    kills = {}
    for i, point in enumerate(KILL_POINTS):
        save = f"{root}/kill{i}"
        r = run(["--save", save, "--save-interval", "2"], fault=point)
        kills[point] = AfterKill(save, r, find_checkpoint(save), os.path.exists(os.path.join(save, "iter_0000004")),
                                 partial_dirs(save), shard_digests(os.path.join(save, "iter_0000002"))
                                 if os.path.isdir(os.path.join(save, "iter_0000002")) else {})
    bad = f"{root}/flipped"
    shutil.copytree(saved, bad)
    name = flip_a_byte(os.path.join(bad, "iter_0000002"))
    te_src = f"{root}/te/ckpt/iter_{TE_SAVE_AT:07d}"
    te_bad = f"{root}/te/flipped"
    if first["te_ref"].returncode == 0:
        shutil.copytree(te_src, te_bad)
        te_flipped = flip_rank_local_byte(te_bad)
    else:
        te_flipped = ""
    te_mem_snap = f"{root}/te/mem/iter_{TE_SAVE_AT:07d}"
    if first["te_mem"].returncode == 0:
        te_mem_saved = rank_local_bytes(te_mem_snap)
        te_mem_persisted = rank_local_bytes(f"{root}/te/mem_ckpt/iter_{TE_SAVE_AT:07d}")
        shutil.copytree(f"{root}/te/mem", f"{root}/te/mem_flipped")
        te_mem_flipped = flip_rank_local_byte(f"{root}/te/mem_flipped/iter_{TE_SAVE_AT:07d}")
    else:
        te_mem_saved, te_mem_persisted, te_mem_flipped = {}, {}, ""
    second = run_scenarios(2, [
        *[job(f"resume{i}", ["--save", kills[p].save, "--load", kills[p].save]) for i, p in enumerate(KILL_POINTS)],
        *[job(f"load_fault{i}", ["--load", saved], fault) for i, (fault, _) in enumerate(LOAD_FAULTS)],
        job("flipped", ["--load", bad]),
        job("weights_only_full", ["--load", f"{root}/weights_only", *layout_flags(2, 1)]),
        job("weights_only_fresh", ["--load", f"{root}/weights_only", *layout_flags(2, 1), "--no-load-optim",
                                   "--train-iters", "5", "--tenplex-resave", f"{root}/weights_only_resaved"]),
        job("ckpt_step_missing", ["--load", f"{root}/weights_only", "--ckpt-step", "3"]),
        job("pretrained", ["--load", f"{root}/nothing", "--pretrained-checkpoint", f"{root}/weights_only",
                           *layout_flags(2, 1), "--train-iters", "3"]),
        job("exit_on_missing", ["--load", f"{root}/nothing", "--exit-on-missing-checkpoint"]),
        job("flipped_no_verify", ["--load", bad, "--tenplex-no-verify", "--exit-interval", "2"]),
        *[te_job(f"te_{tag}", [*layout_flags(tp, 1), "--load", te_src, "--tenplex-resave", f"{root}/te/resaved_{tag}",
                               "--tenplex-metrics", f"{root}/te/{tag}.jsonl"]) for tag, tp in TE_RESTARTS.items()],
        te_job("te_flipped", [*layout_flags(2, 1), "--load", te_bad]),
        # no --save: nothing is written to the memory directories or the durable copy (each restart sees them alike)
        *[te_job(f"te_{tag}", [*layout_flags(tp, 1), "--tenplex-memory", f"{root}/te/{mem}", "--load",
                               f"{root}/te/mem_ckpt", "--tenplex-resave", f"{root}/te/resaved_{tag}",
                               "--tenplex-metrics", f"{root}/te/{tag}.jsonl"])
          for tag, (tp, mem) in TE_MEM_RESTARTS.items()],
    ], f"{root}/second")
    return Results(root, clean_iter2, saved, first, kills, second, name, te_flipped, te_mem_flipped, te_mem_saved,
                   te_mem_persisted)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_during_save_keeps_previous_checkpoint(results: Results, point: str) -> None:
    k = results.kills[point]
    save = k.save
    assert k.killed.returncode != 0 and "tenplex-megatron: done" not in k.killed.log
    assert k.newest == os.path.join(save, "iter_0000002")
    assert not k.has_iter4
    assert k.partials == [os.path.join(save, "iter_0000004.tenplex-partial")]
    assert k.iter2_digests == results.clean_iter2
    # The previous checkpoint loads, training continues, and the next save cleans up the partial directory.
    r = results.second[f"resume{KILL_POINTS.index(point)}"]
    assert r.returncode == 0, r.log[-3000:]
    assert "loaded iteration 2" in r.log and "rng restored exactly" in r.log
    assert f"removed {save}/iter_0000004.tenplex-partial" in r.log
    assert partial_dirs(save) == [] and find_checkpoint(save) == os.path.join(save, "iter_0000004")


def test_disk_full_on_one_rank_fails_cleanly_everywhere(results: Results) -> None:
    save = f"{results.root}/disk_full"
    r = results.first["disk_full"]
    assert r.returncode != 0
    assert f"save of iteration 4 to {save}: writing shards failed on 1 rank(s)" in r.log
    assert "rank 1: OSError: [Errno 28] No space left on device" in r.log
    assert find_checkpoint(save) == os.path.join(save, "iter_0000002")


@pytest.mark.parametrize("case", range(len(LOAD_FAULTS)), ids=[f for f, _ in LOAD_FAULTS])
def test_load_errors_from_every_rank_reach_rank0(results: Results, case: int) -> None:
    failing = LOAD_FAULTS[case][1]
    r = results.second[f"load_fault{case}"]  # every rank's status agrees; the log is rank 0's
    assert r.returncode != 0
    assert f"opening sources failed on {len(failing)} rank(s)" in r.log  # load.read: where sources are opened
    for rank in failing:
        assert f"rank {rank}: RuntimeError: injected fault at load.read on rank {rank}" in r.log


def test_flipped_byte_is_caught_naming_file_and_tensor(results: Results) -> None:
    r = results.second["flipped"]
    assert r.returncode != 0
    assert "rank_00001.safetensors: tensor" in r.log and results.flipped_name in r.log and "fails its checksum" in r.log
    r = results.second["flipped_no_verify"]
    assert r.returncode == 0, r.log[-3000:]


def test_retention_keeps_newest_n(results: Results) -> None:
    save = f"{results.root}/retention"
    r = results.first["retention"]
    assert r.returncode == 0, r.log[-3000:]
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert f"removed {save}/iter_0000002" in r.log


def test_retention_by_interval_and_most_recent_k(results: Results) -> None:
    """--save-retain-interval 3 --most-recent-k 2 --tenplex-keep 4, a save every iteration: the newest two (the
    smaller of K and --tenplex-keep) and every multiple of 3 stay, the rest go."""
    save = f"{results.root}/retain_interval"
    r = results.first["retain_interval"]
    assert r.returncode == 0, r.log[-3000:]
    newest = sorted(range(1, RETAIN_ITERS + 1))[-2:]
    want = sorted({*newest, *(i for i in range(1, RETAIN_ITERS + 1) if i % 3 == 0)})
    assert committed_iterations(save) == want
    for gone in sorted(set(range(1, RETAIN_ITERS + 1)) - set(want)):
        assert f"removed {save}/iter_{gone:07d}" in r.log


def test_weights_only_checkpoint_needs_no_load_optim(results: Results) -> None:
    """--no-save-optim --no-save-rng: checkpoints without optimizer state or RNG, marked weights-only; a load of one
    that wants the optimizer is refused naming the flags, --no-load-optim loads it at TP2 and trains on."""
    save = f"{results.root}/weights_only"
    assert results.first["weights_only"].returncode == 0, results.first["weights_only"].log[-3000:]
    ckpt = find_checkpoint(save)
    with open(os.path.join(ckpt, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["weights_only"] is True and meta["optimizer"] is None and not meta["rng"]
    stored = read_full_tensors(ckpt)
    assert stored and not any(k.startswith("optimizer.") for k in stored)
    full = results.second["weights_only_full"]
    assert full.returncode != 0 and "holds the weights only" in full.log and "--no-load-optim" in full.log
    fresh = results.second["weights_only_fresh"]
    assert fresh.returncode == 0, fresh.log[-3000:]
    assert "loaded iteration 4" in fresh.log and "optimizer and LR schedule left fresh" in fresh.log
    resaved = read_full_tensors(f"{results.root}/weights_only_resaved/iter_0000004")
    assert all(torch.equal(resaved[k], t) for k, t in stored.items())
    assert re.search(r" iteration +5/", fresh.log)


def test_ckpt_step_not_saved_lists_the_steps_there(results: Results) -> None:
    r = results.second["ckpt_step_missing"]
    assert r.returncode != 0
    assert "--ckpt-step 3: no complete tenplex checkpoint of iteration 3" in r.log
    assert "the iterations there: 2, 4" in r.log


def test_pretrained_checkpoint_when_load_holds_none(results: Results) -> None:
    """--pretrained-checkpoint with an empty --load: a fine-tune from its newest checkpoint (a weights-only one
    here: the fine-tune takes nothing else), at TP2, from iteration 0; --exit-on-missing-checkpoint stops instead."""
    r = results.second["pretrained"]
    assert r.returncode == 0, r.log[-3000:]
    assert f"loaded iteration 0 from {results.root}/weights_only/iter_0000004" in r.log
    assert "fine-tune: iteration 0, fresh data position" in r.log
    assert re.search(r" iteration +1/ +3 \| consumed samples: +8 \|", r.log), r.log[-3000:]
    missing = results.second["exit_on_missing"]
    assert missing.returncode != 0
    assert f"--exit-on-missing-checkpoint: no checkpoint under {results.root}/nothing" in missing.log


def _te_losses_continue(root: str, tag: str) -> None:
    want = {m["iteration"]: m["loss"] for m in metrics(f"{root}/te/ref.jsonl")}
    got = metrics(f"{root}/te/{tag}.jsonl")
    assert [m["iteration"] for m in got] == list(range(TE_SAVE_AT + 1, max(want) + 1))
    for m in got:
        assert m["loss"] == pytest.approx(want[m["iteration"]], rel=2e-6), (tag, m)


def _te_restored_exactly(root: str, r: Run, tag: str, want: dict[tuple[str, str], bytes]) -> None:
    """Restart ``tag`` restored every module's extra state: loaded into the modules and saved again from them, it
    equals ``want`` byte for byte, and the losses continue."""
    assert "_extra_state of 8 module(s) restored exactly" in r.log and "re-warm" not in r.log
    resaved = rank_local_bytes(f"{root}/te/resaved_{tag}/iter_{TE_SAVE_AT:07d}")
    assert resaved == want
    _te_losses_continue(root, tag)


def _te_dropped_with_one_warning(root: str, r: Run, tag: str) -> None:
    """Restart ``tag`` at a new layout dropped the extra state with one warning naming the saving layout: the
    modules keep their fresh state, and the losses continue."""
    warnings = [line for line in r.log.splitlines() if "_extra_state" in line]
    assert len(warnings) == 1, warnings
    assert "warning:" in warnings[0] and "amax history re-warm" in warnings[0] and "tp=2,pp=1,dp=1" in warnings[0]
    resaved = rank_local_bytes(f"{root}/te/resaved_{tag}/iter_{TE_SAVE_AT:07d}")
    assert resaved and not any(any(b) for b in resaved.values())  # the fresh modules' state: nothing restored
    _te_losses_continue(root, tag)


def test_te_extra_state_saved_per_rank(results: Results) -> None:
    """Each rank's transformer-layer linears' extra state is in its own file, listed per rank in metadata.json."""
    r = results.first["te_ref"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    saved = rank_local_bytes(f"{results.root}/te/ckpt/iter_{TE_SAVE_AT:07d}")
    with open(f"{results.root}/te/ckpt/iter_{TE_SAVE_AT:07d}/metadata.json") as f:
        section = json.load(f)["rank_local"]
    assert sorted(section) == ["0", "1"]
    for rank, s in section.items():
        assert s["file"] == f"rank_{int(rank):05d}.safetensors"
        modules = {e["module"] for e in s["entries"].values()}
        assert modules == {f"decoder.layers.{i}.{m}" for i in range(2) for m in
                           ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                            "mlp.linear_fc2")}
    assert all(len(b) > 0 and any(b) for b in saved.values())  # trained: amax histories, not a fresh module's zeros
    # each rank's own: a row-parallel linear's input is split over TP, so its amax history differs between the ranks
    assert any(saved[("0", name)] != saved[("1", name)] for name in section["0"]["entries"])


def test_te_extra_state_restored_exactly_at_the_same_layout(results: Results) -> None:
    r = results.second["te_same"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    _te_restored_exactly(results.root, r, "same", rank_local_bytes(f"{results.root}/te/ckpt/iter_{TE_SAVE_AT:07d}"))


def test_te_extra_state_dropped_with_one_warning_at_a_new_layout(results: Results) -> None:
    r = results.second["te_tp1"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    _te_dropped_with_one_warning(results.root, r, "tp1")


def test_te_extra_state_flipped_byte_refused(results: Results) -> None:
    r = results.second["te_flipped"]
    assert r.returncode != 0
    assert "rank_00001.safetensors" in r.log and results.te_flipped in r.log and "checksum" in r.log, r.log[-3000:]


def test_te_extra_state_snapshot_in_memory_and_persisted(results: Results) -> None:
    """A snapshot in node memory keeps each rank's extra state in its rank file, listed as a durable save lists it;
    the background persist carries it to --save unchanged; both equal the durable save of the same state."""
    r = results.first["te_mem"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    assert "snapshot of iteration 3 in host memory" in r.log and "persisted" in r.log
    durable = rank_local_bytes(f"{results.root}/te/ckpt/iter_{TE_SAVE_AT:07d}")  # te_ref's save of iteration 3
    assert results.te_mem_saved and sorted({rank for rank, _ in results.te_mem_saved}) == ["0", "1"]
    assert results.te_mem_saved == durable  # the same training up to iteration 3 (the CPU is deterministic)
    assert results.te_mem_persisted == results.te_mem_saved


def test_te_extra_state_restored_exactly_from_memory_at_the_same_layout(results: Results) -> None:
    r = results.second["te_mem_same"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    assert "loaded iteration 3 from host memory" in r.log and "0 bytes read from durable storage" in r.log
    _te_restored_exactly(results.root, r, "mem_same", results.te_mem_saved)


def test_te_extra_state_from_memory_dropped_with_one_warning_at_a_new_layout(results: Results) -> None:
    r = results.second["te_mem_tp1"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    assert "loaded iteration 3 from host memory" in r.log
    _te_dropped_with_one_warning(results.root, r, "mem_tp1")


def test_te_extra_state_damaged_in_memory_falls_back_to_the_durable_copy(results: Results) -> None:
    """A flipped byte in rank 1's extra state in node memory: that copy is skipped as damaged (one warning naming
    the file, entry and checksum), the snapshot completed with rank 1's file from the persisted durable copy, and
    the bytes come back exactly."""
    r = results.second["te_mem_flipped"]
    assert r.returncode == 0 and "tenplex-megatron: done" in r.log, r.log[-3000:]
    skipped = r.log.split("> tenplex: ")  # each line the library logs, continuation lines (failing ranks) included
    skipped = [x for x in skipped if x.startswith("warning: skipping a damaged copy")]
    assert len(skipped) == 1 and "rank 1: CheckpointFileError" in skipped[0], skipped
    assert "rank_00001.safetensors" in skipped[0] and results.te_mem_flipped in skipped[0]
    assert "fails its block checksums" in skipped[0], skipped
    loaded = next(line for line in r.log.splitlines() if "loaded iteration 3 from host memory" in line)
    assert "0 bytes read from durable storage" not in loaded, loaded  # rank 1's file: the durable copy's
    _te_restored_exactly(results.root, r, "mem_flipped", results.te_mem_saved)
