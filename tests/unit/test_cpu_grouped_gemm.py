"""The CPU stand-in for ``grouped_gemm.ops.gmm`` (``training/cpu_grouped_gemm.py``): forward and backward equal a
matmul per expert under autograd, element by element, with and without ``trans_b``, with experts that get no rows;
the package's argument checks refuse what it refuses; the shim registers it where megatron-core looks."""

from __future__ import annotations

import sys

import pytest
import torch

from tenplex_megatron.training.cpu_grouped_gemm import gmm, module

SIZES = [3, 0, 5, 1]  # an expert with no tokens in between


def _inputs(dtype: torch.dtype, trans_b: bool, sizes: list[int] = SIZES) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    k, n = 6, 4
    a = torch.randn(sum(sizes), k, generator=g).to(dtype)
    b = torch.randn(len(sizes), *((n, k) if trans_b else (k, n)), generator=g).to(dtype)
    return a, b, torch.tensor(sizes, dtype=torch.int64)


def _per_expert(a: torch.Tensor, b: torch.Tensor, sizes: list[int], trans_b: bool) -> torch.Tensor:
    """The reference: one autograd matmul per expert, outputs in group order."""
    return torch.cat([x @ (b[e].t() if trans_b else b[e]) for e, x in enumerate(torch.split(a, sizes))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "b_t"])
def test_forward_and_backward_equal_a_matmul_per_expert(dtype: torch.dtype, trans_b: bool) -> None:
    a, b, sizes = _inputs(dtype, trans_b)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = gmm(a1, b1, sizes, trans_b=trans_b)
    ref = _per_expert(a2, b2, SIZES, trans_b)
    assert out.shape == ref.shape == (sum(SIZES), 4) and out.dtype == dtype
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(a1.grad, a2.grad)
    assert torch.equal(b1.grad, b2.grad)
    assert not b1.grad[1].any()  # the expert with no rows gets a zero gradient, as the package gives it


def test_every_row_goes_to_its_own_expert() -> None:
    """Identity-like experts: expert e multiplies by e + 1, so each output row shows which expert it met."""
    a = torch.ones(4, 2)
    b = torch.stack([torch.eye(2) * (e + 1) for e in range(3)])
    out = gmm(a, b, torch.tensor([1, 2, 1]))
    assert out[:, 0].tolist() == [1.0, 2.0, 2.0, 3.0]


@pytest.mark.parametrize("bad,needle", [
    (lambda a, b, s: (a, b, s.to(torch.int32)), "1-D int64 tensor on the CPU"),
    (lambda a, b, s: (a, b, s[:3]), "3 batch sizes for 4 matrices"),
    (lambda a, b, s: (a, b, s + 1), "do not split a's 9 rows"),
    (lambda a, b, s: (a[:, :5], b, s), "contract over 6"),
    (lambda a, b, s: (a, b.double(), s), "a is torch.float32, b is torch.float64"),
    (lambda a, b, s: (a, b[0], s), "b 3-D"),
])
def test_the_packages_checks(bad, needle: str) -> None:
    a, b, sizes = _inputs(torch.float32, False)
    with pytest.raises(ValueError, match=needle):
        gmm(*bad(a, b, sizes))


def test_registered_where_megatron_core_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import grouped_gemm`` (megatron-core's ``grouped_gemm_util``) finds the stand-in's ``ops.gmm``."""
    package = module()
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", package.ops)
    import grouped_gemm  # noqa: PLC0415

    assert grouped_gemm.ops.gmm is gmm
