"""A malformed field of ``metadata.json`` (or of a safetensors header) is one line naming the file and the field, in
``verify``, ``inspect`` and ``plan`` and in a load, which takes the copy for damaged and falls back to the previous
one: never a traceback, never a silent success (the hostile-checkpoint probe's section 5 and their kin).

The CLI cases read the metadata a save of a tiny GPT at TP 2 writes (its PTC described by the simulation of
megatron's sharding, as ``plan --model`` does), edited field by field; the load cases save and load real tensors
with the engine in one process, through the restart's real fallback.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import pytest
import torch

from tenplex_megatron import cli
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load_chunks
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.memory import fallback
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import gpt_tensors, load_model
from tenplex_megatron.plan.sim.sharding import source_from_layout
from tenplex_megatron.storage.directory import FORMAT_NAME, FORMAT_VERSION, commit, prepare_partial
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.safetensors_header import read_header
from tests.harness import rewrite_metadata

EMB = "embedding.word_embeddings.weight"


def _tiny_checkpoint(save: str) -> str:
    """A committed checkpoint's metadata as a TP 2 save of the catalogue's tiny GPT writes it (no rank files)."""
    dims, layout = load_model("tiny"), ParallelLayout.parse("tp=2,pp=1,dp=1")
    tensors = gpt_tensors(dims, padded_vocab_size(dims.vocab_size, 128, layout.tp))
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "iteration": 4, "framework": "megatron-core",
            "layout": layout.to_json(), "consumed_samples": 16, "use_distributed_optimizer": True,
            "padded_vocab_size": tensors[EMB].global_shape[0],
            "model": {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size,
                      "num_attention_heads": dims.num_attention_heads, "make_vocab_size_divisible_by": 128},
            "files": {"rank_00000.safetensors": 0, "rank_00001.safetensors": 0},
            "ptc": source_from_layout(tensors, layout, True).to_json()}
    prepare_partial(save, 4)
    return commit(save, 4, meta, {})


def _index(meta: dict, key: str) -> int:
    return next(i for i, t in enumerate(meta["ptc"]["tensors"]) if t["key"] == key)


def _set_tensor(key: str, field: str, value: object) -> Callable[[dict], None]:
    return lambda meta: meta["ptc"]["tensors"][_index(meta, key)].update({field: value})


def _extra_tensor(dims: int) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        meta["ptc"]["tensors"].append({"key": "evil", "dtype": "uint8", "shape": [1] * dims})
        meta["ptc"]["chunks"].append({"key": "evil", "offsets": [0] * dims, "shape": [1] * dims, "flat": [0, 1],
                                      "at": {"file": "rank_00000.safetensors", "name": "evil", "rank": 0}})
    return edit


def _chunk0(**fields: object) -> Callable[[dict], None]:
    return lambda meta: meta["ptc"]["chunks"][0].update(fields)


def _at0(**fields: object) -> Callable[[dict], None]:
    return lambda meta: meta["ptc"]["chunks"][0]["at"].update(fields)


def _twice(meta: dict) -> None:
    meta["ptc"]["tensors"].append(dict(meta["ptc"]["tensors"][0]))


def _colliding_names(meta: dict) -> None:
    a, b = meta["ptc"]["chunks"][0], meta["ptc"]["chunks"][1]
    b["at"].update(file=a["at"]["file"], name=a["at"]["name"])


#: (case, edit of the metadata document, the field the error names, what it says): the probe's section 5 first
CASES = [
    ("unknown dtype", _set_tensor(EMB, "dtype", "float128x"), "ptc.tensors[{emb}].dtype", "unknown dtype 'float128x'"),
    ("empty model record", lambda m: m.update(model={}), "model.vocab_size", "missing"),
    ("tp_parts 0", _set_tensor(EMB, "tp_parts", 0), "ptc.tensors[{emb}].tp_parts", "0 is out of range"),
    ("iteration a string", lambda m: m.update(iteration="four"), "iteration", "expected an integer, got str 'four'"),
    ("1500-dimension tensor", _extra_tensor(1500), "ptc.tensors[{last}].shape", "1500 entries, at most 64"),
    ("flat stop of 2**1500", _chunk0(flat=[0, 2**1500]), "ptc.chunks[0].flat[1]", "an integer of 1501 bits is out of range"),
    ("negative chunk size", _chunk0(shape=[-1, 64]), "ptc.chunks[0].shape[0]", "-1 is out of range"),
    ("negative file size", lambda m: m["files"].update({"rank_00000.safetensors": -5}),
     "files['rank_00000.safetensors']", "-5 is out of range"),
    ("tp 0", lambda m: m["layout"].update(tp=0), "layout.tp", "0 is out of range"),
    ("chunks not a list", lambda m: m["ptc"].update(chunks={}), "ptc.chunks", "expected a list, got dict"),
    ("a tensor listed twice", _twice, "ptc.tensors[{last}].key", "is listed twice"),
    ("two chunks under one name", _colliding_names, "ptc.chunks[1].at.name", "also holds another chunk"),
    ("checksum blocks of 0 bytes", _at0(block_bytes=0, block_crc32=[]), "ptc.chunks[0].at.block_bytes", "0 is out of range"),
    ("a flag not a bool", lambda m: m.update(use_distributed_optimizer="yes"), "use_distributed_optimizer",
     "expected true or false"),
    ("a float size", _set_tensor(EMB, "shape", [256.0, 64]), "ptc.tensors[{emb}].shape[0]",
     "expected an integer, got float 256.0"),
    ("tp_axis past the last dimension", _set_tensor(EMB, "tp_axis", 7), "ptc.tensors[{emb}].tp_axis",
     "7 is out of range"),
    ("vocab rows past the rows", _set_tensor(EMB, "vocab_rows", 10**6), "ptc.tensors[{emb}].vocab_rows",
     "1000000 is out of range"),
    ("padded vocabulary 0", lambda m: m.update(padded_vocab_size=0), "padded_vocab_size", "0 is out of range"),
    ("a chunk without its location", lambda m: m["ptc"]["chunks"][0].pop("at"), "ptc.chunks[0].at",
     "expected an object, got NoneType"),
    ("rank-local block size a string", lambda m: m.update(rank_local={"0": {"file": "rank_00000.safetensors",
                                                                              "block_bytes": "x", "entries": {}}}),
     "rank_local['0'].block_bytes", "expected an integer, got str 'x'"),
]


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _line(out: str, start: str) -> str:
    """The rest of the line of ``out`` after ``start`` ('' when ``start`` is not in it)."""
    at = out.find(start)
    return "" if at < 0 else out[at + len(start):].split("\n", 1)[0]


@pytest.mark.parametrize(("edit", "field", "why"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_field_is_one_line_naming_the_file_and_the_field_in_verify_inspect_and_plan(
        tmp_path, capsys, edit, field, why) -> None:
    ckpt = _tiny_checkpoint(str(tmp_path / "save"))
    with open(os.path.join(ckpt, "metadata.json")) as f:
        good = json.load(f)
    rewrite_metadata(ckpt, edit)
    with open(os.path.join(ckpt, "metadata.json")) as f:
        n = len(json.load(f)["ptc"].get("tensors") or ())
    field = field.format(emb=_index(good, EMB), last=n - 1)
    meta_file = os.path.join(ckpt, "metadata.json")
    rc, out = _run(capsys, "verify", ckpt)
    assert rc == 1 and f"DAMAGED  {ckpt}: 1 problem" in out, out
    assert why in _line(out, f"\n  {field}: ") and "damaged files:   metadata.json" in out, out
    for argv in (["inspect", ckpt], ["plan", ckpt, "--to", "tp=1,pp=1,dp=2"]):
        rc, out = _run(capsys, *argv)
        assert rc == 2 and out.count("\n") == 1, out  # one line, no traceback
        assert out.startswith("tenplex_megatron: error: ") and why in _line(out, f"{meta_file}: {field}: "), out


def test_the_good_checkpoint_of_these_cases_passes_inspect_and_plan(tmp_path, capsys) -> None:
    ckpt = _tiny_checkpoint(str(tmp_path / "save"))
    for argv in (["inspect", ckpt], ["plan", ckpt, "--to", "tp=1,pp=1,dp=2"]):
        rc, out = _run(capsys, *argv)
        assert rc == 0 and "error" not in out, out


def test_a_5000_digit_number_in_metadata_json_names_the_file(tmp_path, capsys) -> None:
    ckpt = _tiny_checkpoint(str(tmp_path / "save"))
    path = os.path.join(ckpt, "metadata.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('"iteration": 4', '"iteration": 1' + "7" * 5000, 1))
    rc, out = _run(capsys, "verify", ckpt)
    assert rc == 1 and "\n  malformed JSON: Exceeds the limit" in out and "damaged files:   metadata.json" in out, out
    assert len(out) < 2000, out
    rc, out = _run(capsys, "inspect", ckpt)
    assert rc == 2 and out.count("\n") == 1 and out.startswith("tenplex_megatron: error: "), out  # no traceback


# -- the load: a malformed copy is a damaged copy ---------------------------------------------------------------

FULL = torch.randn(64, 48, generator=torch.Generator().manual_seed(7))


def _local(full: torch.Tensor) -> LocalChunk:
    return LocalChunk(TensorMeta("w", tuple(full.shape), "float32"), Chunk("w", (0, 0), tuple(full.shape)),
                      full.reshape(-1).clone(), True)


def _save_two(save: str) -> tuple[str, str]:
    """Iterations 1 and 2 of one tensor (iteration 2's values differ), each written by the real save."""
    one = save_chunks([_local(FULL)], save, 1, {"tp": 1}, {}, lambda infos: {}).path
    two = save_chunks([_local(FULL + 1)], save, 2, {"tp": 1}, {}, lambda infos: {}).path
    return one, two


def _restart(save: str) -> tuple[fallback.Restart, torch.Tensor]:
    dst = _local(torch.zeros_like(FULL))
    got = fallback.restart(lambda choice: None, lambda path: load_chunks(path, None, lambda m: [dst], lambda m: None),
                           None, None, save, None)
    return got, dst.data.reshape(FULL.shape)


def _huge_header_number(path: str) -> None:
    """A safetensors header whose data offset has 5000 digits (the file's tensor bytes left as they are)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = f.read(n), f.read()
    text = header.decode().replace('"data_offsets":[0,', '"data_offsets":[' + "9" * 5000 + ",", 1)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode() + data)


@pytest.mark.parametrize("damage", ["dtype", "model", "header"])
def test_a_load_takes_a_malformed_copy_for_damaged_and_falls_back_to_the_previous(tmp_path, damage: str) -> None:
    save = str(tmp_path / "save")
    _, two = _save_two(save)
    if damage == "dtype":
        rewrite_metadata(two, _set_tensor("w", "dtype", "float128x"))
        field = f"{two}/metadata.json: ptc.tensors[0].dtype: unknown dtype 'float128x'"
    elif damage == "model":
        rewrite_metadata(two, lambda m: m.update(model={}))
        field = f"{two}/metadata.json: model.vocab_size: missing"
    else:
        _huge_header_number(os.path.join(two, "rank_00000.safetensors"))
        field = f"{two}/rank_00000.safetensors: malformed safetensors header: Exceeds the limit"
        with pytest.raises(CheckpointFileError, match="malformed safetensors header"):
            read_header(os.path.join(two, "rank_00000.safetensors"))
    with pytest.raises(RankFailure) as err:  # the damaged copy alone: one error naming the file and the field
        load_chunks(two, None, lambda m: [_local(torch.zeros_like(FULL))], lambda m: None)
    assert f"CheckpointFileError: {field}" in str(err.value) and "Traceback" not in str(err.value)
    got, data = _restart(save)
    assert got.result.path.endswith("iter_0000001") and torch.equal(data, FULL)  # the previous copy, whole
    assert len(got.skipped) == 1 and field in got.skipped[0]


def test_a_model_record_without_the_shape_verifies_and_plan_names_what_it_lacks(tmp_path, capsys) -> None:
    """A user's own loop records the vocabulary and seed only (``live_job`` without args): its metadata reads
    (``inspect``; the test_public_api launch loads one); ``plan``, which needs the model's shape, says which field is
    missing in one line."""
    ckpt = _tiny_checkpoint(str(tmp_path / "save"))
    rewrite_metadata(ckpt, lambda m: m.update(model={"vocab_size": m["model"]["vocab_size"], "seed": 1234}))
    rc, out = _run(capsys, "inspect", ckpt)
    assert rc == 0 and "error" not in out, out
    rc, out = _run(capsys, "plan", ckpt, "--to", "tp=1,pp=1,dp=2")
    meta_file = os.path.join(ckpt, "metadata.json")
    assert rc == 2 and out.count("\n") == 1, out
    assert f"{meta_file}: model.num_layers: missing (plan needs the model's shape)" in out, out
