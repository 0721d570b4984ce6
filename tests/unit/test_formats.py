"""Every checkpoint format is recognised in one place (``storage/formats.py``), from what is on disk: a directory of
each kind as its writer lays it out (the names and the metadata fields the recognisers read), and one of none."""

from __future__ import annotations

import json
import os

import pytest

from tenplex_megatron.storage import formats


def _layout(root: str, kind: str) -> str:
    """A checkpoint directory of ``kind`` as its writer names its files."""
    path = os.path.join(root, kind)
    os.makedirs(path)
    files = {
        formats.TENPLEX: {"metadata.json": json.dumps({"format": formats.FORMAT_NAME, "format_version": 2})},
        formats.TORCH_DIST: {"metadata.json": json.dumps({"sharded_backend": "torch_dist",
                                                          "sharded_backend_version": 1}), "common.pt": ""},
        formats.LEGACY_TORCH: {"mp_rank_00/model_optim_rng.pt": ""},
        formats.DEEPSPEED: {"latest": "global_step4", "global_step4/mp_rank_00_model_states.pt": ""},
        formats.HUGGING_FACE: {"config.json": "{}", "model.safetensors.index.json": "{}"},
        "none": {"notes.txt": "not a checkpoint"},
    }[kind]
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return path


@pytest.mark.parametrize("kind", [*formats.FORMATS, "none"])
def test_each_format_is_recognised_as_itself_and_nothing_else(tmp_path, kind: str) -> None:
    path = _layout(str(tmp_path), kind)
    assert formats.recognise(path) == (None if kind == "none" else kind)
    hits = [name for name, test in formats.RECOGNISERS if test(path)]
    assert hits == ([] if kind == "none" else [kind])


def test_a_tenplex_metadata_file_wins_and_a_malformed_one_is_no_format(tmp_path) -> None:
    """Precedence: tenplex first (a DeepSpeed ``latest`` beside tenplex's metadata.json is tenplex's); a metadata.json
    that does not parse is none of the metadata formats (a load then names the damage)."""
    path = _layout(str(tmp_path), formats.TENPLEX)
    open(os.path.join(path, "latest"), "w").close()
    assert formats.recognise(path) == formats.TENPLEX
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write("{not json")
    assert formats.recognise(path) is None
