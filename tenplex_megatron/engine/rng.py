"""RNG state as JSON, and the policy for restoring it (one policy for every framework).

Same layout: every rank gets back exactly the states it saved (Python, NumPy,
torch CPU/CUDA, and megatron-core's model-parallel RNG tracker). Changed
layout: the streams cannot be carried over (their number and meaning depend on
TP and PP), so every rank re-seeds them deterministically from
``(seed, iteration)`` with megatron-core's own ``model_parallel_cuda_manual_seed``:
a resume at a given layout is reproducible, and dropout masks after the
restart differ from those of an uninterrupted run.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from tenplex_megatron.storage.source import Metadata


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture(tracker: bool = True) -> dict[str, Any]:
    """This rank's RNG states, JSON-serialisable (``tracker``: with megatron-core's model-parallel streams)."""
    py = random.getstate()
    npst = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if tracker:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["tracker"] = {k: _b64(v) for k, v in get_cuda_rng_tracker().get_states().items()}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back exactly what :func:`capture` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    if "tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states({k: _unb64(v) for k, v in state["tracker"].items()})


def reseed(seed: int, iteration: int, tracker: bool = True) -> None:
    """The changed-layout policy: deterministic fresh streams from (seed, iteration)."""
    s = seed + 7919 * iteration
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    if tracker:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(s)


def apply_policy(metadata: Metadata, layout: dict[str, Any], rank: int, seed: int, iteration: int,
                 tracker: bool = True) -> bool:
    """Restore this rank's saved streams when the layout is the saved one, else re-seed; returns whether exact."""
    saved = metadata.rng
    exact = metadata.layout == layout and rank in saved
    if exact:
        restore(dict(saved[rank]))
    else:
        reseed(seed, iteration, tracker)
    return exact
