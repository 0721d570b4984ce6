"""A Hugging Face directory as a PTC source: bad directories refused naming the file and tensor, slices read exactly.

The directories are written here with the project's safetensors writer, laid
out as transformers lays them out (shards plus ``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tenplex_megatron.integrations.hf.source import HFSource, open_hf, read_hf_dir
from tenplex_megatron.plan.hf_map import HFMapError, build_mapping, hf_config
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.safetensors_io import write_safetensors
from tests.unit.test_hf_map import GPT2_FACTS


def _write_dir(path: str) -> dict[str, torch.Tensor]:
    os.makedirs(path)
    _, cfg = hf_config(GPT2_FACTS, "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "model_type": "gpt2"}, f)
    g = torch.Generator().manual_seed(0)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in build_mapping(GPT2_FACTS).hf}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, members in shards.items():
        write_safetensors(os.path.join(path, fname), {n: tensors[n] for n in members})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fn for fn, ms in shards.items() for n in ms}}, f)
    return tensors


def test_links_read_exact_slices(tmp_path) -> None:
    d = str(tmp_path / "hf")
    tensors = _write_dir(d)
    opened = open_hf(d, GPT2_FACTS)
    assert isinstance(opened.files, HFSource)
    for sc in opened.ptc.chunks:
        link = opened.files.links[(sc.location.file, sc.location.name)]
        t = tensors[link.hf]
        want = t[:, link.lo : link.lo + link.n].t() if link.transposed else t[link.lo : link.lo + link.n]
        assert torch.equal(opened.files.flat(sc), want.reshape(-1)), sc.location.name
    opened.files.close()


def test_missing_shard_names_file_and_tensor(tmp_path) -> None:
    d = str(tmp_path / "hf")
    _write_dir(d)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointFileError, match=r"model-00002-of-00002.safetensors: missing shard .*tensor '"):
        read_hf_dir(d)


def test_truncated_shard_names_file_and_tensor(tmp_path) -> None:
    d = str(tmp_path / "hf")
    _write_dir(d)
    path = os.path.join(d, "model-00001-of-00002.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointFileError, match=r"model-00001-of-00002.safetensors: tensor '.*truncated"):
        read_hf_dir(d)


def test_index_naming_an_absent_tensor(tmp_path) -> None:
    d = str(tmp_path / "hf")
    _write_dir(d)
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    idx["weight_map"]["transformer.h.9.ln_1.weight"] = "model-00001-of-00002.safetensors"
    with open(index, "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointFileError,
                       match=r"model-00001-of-00002.safetensors: tensor 'transformer.h.9.ln_1.weight' is not in the file"):
        read_hf_dir(d)


def test_missing_or_misshapen_tensor_and_foreign_config(tmp_path) -> None:
    d = str(tmp_path / "hf")
    _write_dir(d)
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    del idx["weight_map"]["transformer.h.1.mlp.c_fc.bias"]
    with open(index, "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointFileError, match="tensor 'transformer.h.1.mlp.c_fc.bias' is missing"):
        open_hf(d, GPT2_FACTS)
    with pytest.raises(HFMapError, match=r"num_layers is 2 in the Hugging Face config but 3 from the flags"):
        open_hf(d, GPT2_FACTS.__class__(**{**GPT2_FACTS.__dict__, "num_layers": 3}))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "model_type": "bert"}, f)
    with pytest.raises(HFMapError, match=r"config.json: model_type='bert' is not supported"):
        open_hf(d, GPT2_FACTS)
