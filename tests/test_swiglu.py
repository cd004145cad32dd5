"""Fused SwiGLU (``fot.kernels.swiglu``, in ``fot.kernels.mlp_ops``) and the MLP that uses it.

Oracle: ``silu(gate) * up`` in float64 with autograd. On CPU the Triton kernels run under
``TRITON_INTERPRET=1`` (set by conftest); with a GPU they run compiled.

Tolerances (elementwise ``|got - want| <= RTOL * |want| + ATOL * max|want|``): float32 math
inside and one rounding per output, so ~1e-6 relative in float32 and one bfloat16 rounding in
bfloat16 (2**-8 relative with round-to-nearest; 2**-7 under the interpreter, which truncates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close

from fot.kernels import mlp_ops, swiglu

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16_STEP = 2.0**-8 if HAS_CUDA else 2.0**-7
TOL = {torch.float32: (2e-6, 1e-7), torch.bfloat16: (BF16_STEP, 1e-6)}


def oracle(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` and its input gradient, in float64."""
    x64 = x.detach().double().requires_grad_(True)
    gate, up = x64.chunk(2, dim=-1)
    y = F.silu(gate) * up
    y.backward(dy.double())
    return y.detach(), x64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 5, 14), (3, 128), (1, 7, 2 * 1030)])
def test_swiglu_matches_float64_oracle(shape, dtype) -> None:
    """Output and input gradient against float64 autograd, for odd widths, a width above one
    1024-column block, and 2-D and 3-D inputs."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype).to(DEVICE)
    want_y, want_dx = oracle(x.cpu(), dy.cpu())
    xg = x.clone().requires_grad_(True)
    y = swiglu(xg)
    y.backward(dy)
    assert y.dtype == dtype and xg.grad.dtype == dtype
    assert_close(y.cpu(), want_y, TOL[dtype], "y")
    assert_close(xg.grad.cpu(), want_dx, TOL[dtype], "dx")


def test_swiglu_strided_input_and_gradient() -> None:
    """A column slice of a wider tensor (row stride != width) and a non-contiguous incoming
    gradient give the same result as contiguous copies."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 40, generator=g).to(DEVICE)
    x = wide[:, 4:36]  # (6, 32), row stride 40
    dy_t = torch.randn(16, 6, generator=g).to(DEVICE)
    dy = dy_t.t()  # (6, 16), non-contiguous
    want_y, want_dx = oracle(x.cpu(), dy.cpu())
    xg = x.detach().requires_grad_(True)
    assert xg.stride() == (40, 1)
    y = swiglu(xg)
    y.backward(dy)
    assert_close(y.cpu(), want_y, TOL[torch.float32], "y")
    assert_close(xg.grad.cpu(), want_dx, TOL[torch.float32], "dx")


def test_swiglu_pytorch_fallback_off_cuda(monkeypatch) -> None:
    """Off CUDA without the interpreter the same function runs as PyTorch ops."""
    if HAS_CUDA:
        pytest.skip("the fallback is for tensors that are not on CUDA; covered on CPU runs")
    monkeypatch.setattr(mlp_ops, "_interpreting", lambda: False)
    calls = []
    monkeypatch.setattr(mlp_ops._SwiGLUFn, "apply", lambda *a: calls.append(a))
    x = torch.randn(3, 8, requires_grad=True)
    dy = torch.randn(3, 4)
    want_y, want_dx = oracle(x, dy)
    y = swiglu(x)
    y.backward(dy)
    assert not calls
    assert_close(y.detach(), want_y, TOL[torch.float32], "y")
    assert_close(x.grad, want_dx, TOL[torch.float32], "dx")


def test_swiglu_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"last dim of 2 \* I"):
        swiglu(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(TypeError, match=r"float16, bfloat16 or float32, got torch\.int64"):
        swiglu(torch.ones(2, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match=r"takes a torch\.Tensor"):
        swiglu([1.0, 2.0])


def test_mlp_fused_equals_pytorch_path(monkeypatch) -> None:
    """The MLP of a tiny FoT on the Triton backend (fused SwiGLU) equals the same MLP on the
    reference backend (``silu(gate) * up`` in PyTorch): output and every weight gradient."""
    from fot import presets
    from fot.models import modeling_fot

    torch.manual_seed(0)
    cfg = presets.config("fot_pro", "tiny", vocab_size=300, attn_backend="triton")
    mlp = modeling_fot.FoTMLP(cfg).to(DEVICE)
    x = torch.randn(2, 9, cfg.hidden_size, device=DEVICE)

    def run(backend: str):
        mlp.config.attn_backend = backend
        mlp.zero_grad()
        xg = x.clone().requires_grad_(True)
        y = mlp(xg)
        y.square().sum().backward()
        return y.detach(), xg.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}

    want = run("reference")
    calls = []
    real = mlp_ops._SwiGLUFn.apply

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(mlp_ops._SwiGLUFn, "apply", spy)
    got = run("triton")
    assert calls, "the fused kernel did not run on the triton backend"
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(got[1], want[1], atol=1e-5, rtol=1e-4)
    for name, grad in want[2].items():
        assert torch.allclose(got[2][name], grad, atol=1e-5, rtol=1e-4), name
