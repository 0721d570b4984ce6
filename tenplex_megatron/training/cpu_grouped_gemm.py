"""A pure-torch stand-in for the ``grouped_gemm`` package on a CPU-only machine (tests, CI, the demo).

megatron-core's legacy grouped-GEMM experts (``GroupedMLP``, ``--moe-grouped-gemm`` with the local spec) call
``grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b=False)``: the rows of ``a`` (tokens x k) are split into
consecutive groups of ``batch_sizes`` rows (a 1-D int64 tensor on the CPU, one size per expert), and group ``e`` is
multiplied by expert ``e``'s matrix ``b[e]`` (k x n; with ``trans_b`` ``b[e]`` is n x k and is transposed). The
package is a CUDA extension (CUTLASS / cuBLAS, bf16 only); this module computes the same with one ``torch.matmul``
per expert, forward and backward as the package's autograd function defines them: the input's gradient is the
grouped product of the output's gradient with the transposed matrices, each matrix's gradient the product of its
group's inputs (transposed) with its group's output gradient (zero for an expert that got no rows). Its argument
checks are the package's, so a call megatron-core would not make on a GPU fails here too. The CPU shim
(``cpu_shim.install``) registers it as the module ``grouped_gemm`` before megatron-core imports its
``grouped_gemm_util``; it is never used on a GPU.
"""

from __future__ import annotations

import types

import torch


def _check(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool) -> None:
    """The package's own argument checks (``csrc/grouped_gemm.cu``), except the device and bf16-only ones."""
    if batch_sizes.device.type != "cpu" or batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64:
        raise ValueError(f"gmm: batch_sizes must be a 1-D int64 tensor on the CPU, got {batch_sizes.dtype} "
                         f"{tuple(batch_sizes.shape)} on {batch_sizes.device}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"gmm: a must be 2-D and b 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"gmm: a is {a.dtype}, b is {b.dtype}")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ValueError(f"gmm: a has {a.shape[1]} columns, b's matrices contract over {k} (trans_b={trans_b})")
    if batch_sizes.shape[0] != b.shape[0]:
        raise ValueError(f"gmm: {batch_sizes.shape[0]} batch sizes for {b.shape[0]} matrices")
    if int(batch_sizes.sum()) != a.shape[0] or bool((batch_sizes < 0).any()):
        raise ValueError(f"gmm: batch sizes {batch_sizes.tolist()} do not split a's {a.shape[0]} rows")


def _groups(a: torch.Tensor, batch_sizes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.split(a, batch_sizes.tolist())


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """Group ``e`` of ``a``'s rows times ``b[e]`` (transposed with ``trans_b``), groups in order."""
    n = b.shape[1] if trans_b else b.shape[2]
    parts = [x @ (b[e].t() if trans_b else b[e]) for e, x in enumerate(_groups(a, batch_sizes))]
    return torch.cat(parts) if parts else a.new_empty((0, n))


def _gmm_trans_a(x: torch.Tensor, y: torch.Tensor, batch_sizes: torch.Tensor) -> torch.Tensor:
    """Per group ``e``: ``x_e^T @ y_e`` (the package's ``trans_a`` variant: one matrix per expert, zero for an expert
    with no rows)."""
    return torch.stack([xe.t() @ ye for xe, ye in zip(_groups(x, batch_sizes), _groups(y, batch_sizes))])


class _GroupedGemm(torch.autograd.Function):
    """``gmm`` with the package's backward."""

    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):  # noqa: D102
        ctx.save_for_backward(a, b, batch_sizes)
        ctx.trans_b = trans_b
        return _gmm(a, b, batch_sizes, trans_b)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = grad.contiguous()
        a, b, batch_sizes = ctx.saved_tensors
        agrad = _gmm(grad, b, batch_sizes, not ctx.trans_b) if ctx.needs_input_grad[0] else None
        bgrad = None
        if ctx.needs_input_grad[1]:
            bgrad = _gmm_trans_a(grad, a, batch_sizes) if ctx.trans_b else _gmm_trans_a(a, grad, batch_sizes)
        return agrad, bgrad, None, None


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``: rows of ``a`` split by ``batch_sizes``, each group times its expert's matrix."""
    _check(a, b, batch_sizes, trans_b)
    return _GroupedGemm.apply(a, b, batch_sizes, trans_b)


def module() -> types.ModuleType:
    """A ``grouped_gemm`` module whose ``ops.gmm`` is :func:`gmm` (what ``grouped_gemm_util`` reads)."""
    package = types.ModuleType("grouped_gemm", "tenplex-megatron's CPU stand-in for the grouped_gemm package")
    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = gmm  # type: ignore[attr-defined]
    package.ops = ops  # type: ignore[attr-defined]
    package.__path__ = []  # a package, so `import grouped_gemm.ops` finds the registered submodule
    return package
