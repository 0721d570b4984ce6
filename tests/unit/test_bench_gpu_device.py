"""``python -m benchmarks.gpu_reshard --device``: CUDA devices get an explicit index (a bare ``cuda`` made
``torch.cuda.set_device`` raise), other device types and malformed names are refused by name."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_reshard import parse_device
from tests.harness import ROOT


@pytest.mark.parametrize("text,want", [("cpu", "cpu"), ("cuda", "cuda:0"), (" cuda ", "cuda:0"), ("cuda:0", "cuda:0")])
def test_a_cuda_device_always_has_an_index(text: str, want: str) -> None:
    got = parse_device(text)
    assert got == torch.device(want) and str(got) == want
    if got.type == "cuda":
        assert got.index is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="index bounds are checked against the GPUs present")
def test_an_index_is_kept_where_no_gpu_can_check_it() -> None:
    assert parse_device("cuda:3") == torch.device("cuda", 3)


@pytest.mark.parametrize("text,message", [("gpu", "is not a device"), ("meta", "only cpu and cuda"),
                                          ("cuda:x", "is not a device")])
def test_other_devices_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_device(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine cuda is valid")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_reshard", "--device", "cuda",
                        "--models", "tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--device cuda:0: torch" in p.stderr and "sees no CUDA device" in p.stderr, p.stderr
