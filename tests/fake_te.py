"""Test support: megatron-core's own linear layers carrying Transformer Engine's kind of ``_extra_state``.

Transformer Engine itself needs a GPU (its kernels are CUDA), so it cannot run here. What tenplex handles of it is
torch's generic extra-state protocol, which TE implements: ``get_extra_state`` returns the module's FP8 metadata
serialized into a uint8 tensor, ``set_extra_state`` reads such a tensor back. Inside :func:`fake_te_extra_state`,
megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear`` do the same with an FP8-style amax history of
their inputs (float32, updated by every forward, never used in the computation, so losses are unchanged): a fresh
module's history is zeros, a trained one's is not. Only the transformer layers' linears (built with a
``tp_comm_buffer_name``, as the TE spec's are) carry it: GPTModel's output layer is megatron-core's own in a TE model
too, and megatron-core asserts that its extra state is empty. Used by tests only, never by the plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

HISTORY = 4  # amax history length (TE's default is 1024; tiny here)


def _meta(module: Any) -> torch.Tensor:
    meta = getattr(module, "_fake_fp8_meta", None)
    if meta is None:  # [amax history..., forward count]
        meta = module._fake_fp8_meta = torch.zeros(HISTORY + 1, dtype=torch.float32)
    return meta


def _get_extra_state(self: Any) -> torch.Tensor | None:
    if not getattr(self, "_fake_te", False):
        return None
    return _meta(self).clone().view(torch.uint8)  # TE: pickle.dumps(fp8 meta) as a uint8 tensor


def _set_extra_state(self: Any, state: Any) -> None:
    if isinstance(state, torch.Tensor) and state.numel():
        self._fake_fp8_meta = state.detach().clone().view(torch.float32)


@contextmanager
def fake_te_extra_state() -> Iterator[None]:
    """Within: megatron-core's tensor-parallel linear layers keep and serialize an amax history as TE does."""
    saved = {c: (c.get_extra_state, c.set_extra_state, c.forward, c.__init__)
             for c in (ColumnParallelLinear, RowParallelLinear)}

    def wrap_init(init: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self._fake_te = kwargs.get("tp_comm_buffer_name") is not None
        return __init__

    def wrap(forward: Any) -> Any:
        def fwd(self: Any, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with torch.no_grad():
                meta = _meta(self)
                meta[1:HISTORY] = meta[: HISTORY - 1].clone()
                meta[0] = input_.detach().abs().max().float()
                meta[HISTORY] += 1
            return forward(self, input_, *args, **kwargs)
        return fwd

    try:
        for cls, (_, _, forward, init) in saved.items():
            cls.__init__ = wrap_init(init)  # type: ignore[method-assign]
            cls.get_extra_state = _get_extra_state  # type: ignore[method-assign]
            cls.set_extra_state = _set_extra_state  # type: ignore[method-assign]
            cls.forward = wrap(forward)  # type: ignore[method-assign]
        yield
    finally:
        for cls, (get, set_, forward, init) in saved.items():
            cls.get_extra_state, cls.set_extra_state, cls.forward = get, set_, forward  # type: ignore[method-assign]
            cls.__init__ = init  # type: ignore[method-assign]
