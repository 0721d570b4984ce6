"""``storage/megatron_summary.read_torch_pickle``: a ``torch.save`` file's plain values and every tensor's shape and
dtype, read without torch, as Megatron's ``model_optim_rng.pt`` / ``common.pt`` hold them; any other class is refused
naming the file and the class. (Real Megatron checkpoints: ``tests/multiproc/test_megatron_adopt.py``.)"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch

from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.megatron_summary import TensorStub, read_torch_pickle
from tests.harness import ROOT


class NotPlain:
    """A class no Megatron checkpoint holds."""


def _state() -> dict:
    model = OrderedDict(w=torch.zeros(3, 4, dtype=torch.bfloat16), b=torch.ones(4), n=torch.arange(5)[1:])
    model._metadata = {"": {"version": 1}}  # as Module.state_dict() leaves it
    return {"args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.float32),
            "model": model, "checkpoint_version": 3.0, "iteration": 7,
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 2, dtype=torch.float16)}},
                          # the Float16 optimizer's fp32 main params are Parameters
                          "fp32_from_fp16_params": [[torch.nn.Parameter(torch.zeros(3, 4))]]},
            "rng_state": [{"np_rng_state": np.random.get_state()}]}


def test_reads_plain_values_and_tensor_shapes(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(tmp_path, "model_optim_rng.pt")
    state = _state()
    torch.save(state, path)
    got = read_torch_pickle(path)
    assert got["iteration"] == 7 and got["checkpoint_version"] == 3.0
    assert got["args"].tensor_model_parallel_size == 2 and got["args"].params_dtype == "float32"
    for name, t in state["model"].items():
        want = TensorStub(tuple(t.shape), str(t.dtype).removeprefix("torch."))
        assert got["model"][name] == want, name
    st = got["optimizer"]["state"][0]
    assert st["step"] == TensorStub((), "float32") and st["exp_avg"] == TensorStub((2, 2), "float16")
    assert got["optimizer"]["fp32_from_fp16_params"] == [[TensorStub((3, 4), "float32")]]


def test_reads_without_torch(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(tmp_path, "model_optim_rng.pt")
    torch.save(_state(), path)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tenplex_megatron.storage.megatron_summary import read_torch_pickle\n"
            "print(read_torch_pickle(sys.argv[1])['model']['w'].shape)")
    p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout.strip() == "(3, 4)", p.stderr[-2000:]


def test_other_classes_are_refused_naming_file_and_class(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(tmp_path, "common.pt")
    torch.save({**_state(), "extra": NotPlain()}, path)
    with pytest.raises(CheckpointFileError, match=r"common\.pt: names (tests\.unit\.)?test_megatron_summary\.NotPlain"):
        read_torch_pickle(path)
