"""Mixed-precision and few-row linear (``fot.kernels.linear_ops``) and their use in
``fused_linear``.

Oracles: autocast's own ``F.linear`` for the forward and the input gradient (the same 16-bit
operands and GEMM, so equal), and float64 products of the 16-bit-rounded operands for the
weight gradient (float32 accumulation with a float32 result: ~1e-6 relative). Runs on the CPU
(float32 matmul of the rounded operands) and, with a GPU, on CUDA (cuBLAS with a float32
output). The few-row kernel (a decode step's projections) runs under Triton's interpreter on
the CPU; its oracle is the float64 product with the concatenated weights. The few-row
forget gate's oracle is the float64 log-sigmoid of the float64 product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fot.kernels.linear_ops import (
    few_rows_linear,
    few_rows_linear_supported,
    few_rows_logsigmoid_linear,
    few_rows_logsigmoid_linear_supported,
    mixed_precision_linear,
)
from fot.models.modeling_fot import fused_linear

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels; CPU: interpreter


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("widths", [[24], [16, 8, 8, 3]])
def test_fused_linear_mixed_matches_autocast_with_float32_weight_grads(device, widths) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(40, n, bias=False, device=device) for n in widths]
    x = torch.randn(2, 33, 40, device=device, requires_grad=True)
    dy = torch.randn(2, 33, sum(widths), device=device).bfloat16()

    def run(mixed: bool):
        for layer in layers:
            layer.weight.grad = None
        x.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fused_linear(x, layers, mixed=mixed)
        y.backward(dy)
        return y.detach(), x.grad.clone(), [layer.weight.grad.clone() for layer in layers]

    y_ref, dx_ref, dw_ref = run(False)  # autocast's F.linear
    y, dx, dw = run(True)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert dx.dtype == torch.float32
    assert rel(dx, dx_ref) < 1e-6  # same bf16 GEMM (CPU and cuBLAS may split K differently)
    # weight gradient oracle: float64 products of the bf16 operands
    x16 = x.detach().bfloat16().double().reshape(-1, 40)
    oracle = (dy.double().reshape(-1, sum(widths)).t() @ x16).split(widths)
    for got, ref, want in zip(dw, dw_ref, oracle, strict=True):
        assert got.dtype == torch.float32
        assert rel(got, want) < 1e-5, rel(got, want)
        assert rel(ref, want) > 1e-4  # autocast rounds its weight gradient to bf16 first


def test_mixed_precision_linear_without_weight_grads_and_errors() -> None:
    w = torch.randn(6, 5)
    x = torch.randn(3, 5, requires_grad=True)
    y = mixed_precision_linear(x, [w], torch.bfloat16)
    y.sum().backward()
    want = torch.ones(3, 6).bfloat16() @ w.bfloat16()
    assert torch.equal(x.grad, want.float())
    assert torch.equal(y, F.linear(x.bfloat16(), w.bfloat16()))
    with pytest.raises(TypeError, match=r"must be torch\.float16 or"):
        mixed_precision_linear(x, [w], torch.float32)
    with pytest.raises(ValueError, match="at least one"):
        mixed_precision_linear(x, [], torch.bfloat16)
    with pytest.raises(TypeError, match=r"weights\[1\] must be a float32 \[N, 5\]"):
        mixed_precision_linear(x, [w, torch.randn(6, 4)], torch.bfloat16)
    with pytest.raises(TypeError, match="float32"):
        mixed_precision_linear(x, [w.bfloat16()], torch.bfloat16)


@pytest.mark.parametrize(
    ("x", "weights", "match"),
    [
        (torch.randn(3, 5), torch.randn(6, 5), "weights must be a list or tuple"),
        ([0.0] * 5, [torch.randn(6, 5)], "x must be a floating tensor"),
        (torch.tensor(1.0), [torch.randn(6, 1)], "x must be a floating tensor"),
        (torch.ones(3, 5, dtype=torch.long), [torch.randn(6, 5)], "x must be a floating"),
    ],
)
def test_mixed_precision_linear_refuses_a_bare_weight_and_a_bad_x(x, weights, match) -> None:
    """One weight passed without a list, a non-tensor, 0-d or integer x: a TypeError that says
    what to pass (they raised torch's "Boolean value of Tensor ... is ambiguous", an
    AttributeError or an IndexError, or cast integers silently)."""
    with pytest.raises(TypeError, match=match):
        mixed_precision_linear(x, weights, torch.bfloat16)


@pytest.mark.parametrize(("K", "widths"), [(0, [6, 2]), (5, [0]), (5, [0, 0])])
def test_mixed_precision_linear_backward_with_zero_features_or_outputs(K, widths) -> None:
    """K = 0 input features or no output columns: zero (empty) gradients of the right shapes
    (backward's reshape(-1, 0) raised "cannot reshape tensor of 0 elements")."""
    x = torch.randn(3, 4, K, requires_grad=True)
    ws = [torch.randn(n, K, requires_grad=True) for n in widths]
    y = mixed_precision_linear(x, ws, torch.bfloat16)
    assert y.shape == (3, 4, sum(widths))
    grads = torch.autograd.grad(y.float().sum(), [x, *ws])
    for g, t in zip(grads, [x, *ws], strict=True):
        assert g.shape == t.shape and not g.any()
    assert all(g.dtype == torch.float32 for g in grads)


def test_fused_linear_mixed_falls_back_outside_autocast_and_for_other_layers() -> None:
    """No autocast, or a layer that is not a plain nn.Linear (a subclass may change forward):
    the ordinary path, in the layers' own dtype."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plain = nn.Linear(8, 3, bias=False)
    assert torch.equal(fused_linear(x, [plain], mixed=True), plain(x))  # float32, no autocast
    scaled = Scaled(8, 3, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear(x, [scaled], mixed=True)
    assert torch.equal(got, 2 * F.linear(x.bfloat16(), scaled.weight.bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "K", "widths"),
    [((1, 1), 100, [48, 24, 5]), ((2, 8), 37, [17]), ((16,), 300, [8, 8, 8, 8, 8, 8, 3, 33])],
)
def test_few_rows_linear_matches_the_product_with_concatenated_weights(
    dtype, rows, K, widths
) -> None:
    """The few-row kernel (CPU: interpreter) against float64 products of the same operands:
    uneven widths (column blocks that end inside a layer), K not a multiple of its K tile,
    up to eight weights and sixteen rows."""
    torch.manual_seed(K)
    x = torch.randn(*rows, K).to(DEVICE, dtype)
    ws = [torch.randn(n, K).to(DEVICE, dtype) for n in widths]
    y = few_rows_linear(x, ws)
    want = x.double() @ torch.cat(ws).double().t()
    assert y.dtype == dtype and y.shape == (*rows, sum(widths))
    assert rel(y, want) < (1e-6 if dtype == torch.float32 else 4e-3)


def test_fused_linear_takes_few_rows_through_one_launch_without_grad() -> None:
    """A decode step's projections (a few rows, no autograd) go through few_rows_linear when
    the kernels may run (``mixed``), with the result of the concatenated GEMM; with autograd
    on, more rows or ``mixed=False`` the GEMM over concatenated weights runs as before."""
    torch.manual_seed(0)
    layers = [nn.Linear(40, n, bias=False, device=DEVICE) for n in (24, 16, 3)]
    x = torch.randn(2, 1, 40, device=DEVICE)
    want = F.linear(x, torch.cat([layer.weight for layer in layers]))
    calls = []
    import fot.kernels.linear_ops as linear_ops

    real = linear_ops.few_rows_linear

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    linear_ops.few_rows_linear = spy
    try:
        with torch.no_grad():
            got = fused_linear(x, layers, mixed=True)
            assert calls == [x.shape]
            fused_linear(x, layers, mixed=False)
            fused_linear(torch.randn(17, 40, device=DEVICE), layers, mixed=True)
        fused_linear(x, layers, mixed=True)  # weights need gradients
        assert calls == [x.shape]
    finally:
        linear_ops.few_rows_linear = real
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: (torch.randn(17, 8), [torch.randn(4, 8)]), "17 rows"),
        (lambda: (torch.randn(1, 8), [torch.randn(2, 8)] * 9), "nine weights"),
        (lambda: (torch.randn(1, 8), [torch.randn(4, 8).half()]), "another dtype"),
        (lambda: (torch.randn(1, 8), [torch.randn(8, 4).t()]), "a transposed weight"),
        (lambda: (torch.randn(1, 8), [torch.randn(4, 7)]), "K mismatch"),
        (lambda: (torch.randn(1, 8, dtype=torch.float64), [torch.randn(4, 8).double()]), "fp64"),
        (lambda: (torch.randn(1, 8), []), "no weight"),
        (lambda: (torch.randn(3, 0), [torch.randn(5, 0)]), "K = 0 (F.linear gives zeros)"),
    ],
)
def test_few_rows_linear_refuses_what_it_does_not_take(make, why) -> None:
    x, ws = make()
    x, ws = x.to(DEVICE), [w.to(DEVICE) for w in ws]
    assert not few_rows_linear_supported(x, ws), why
    with pytest.raises(ValueError, match=r"use F\.linear"):
        few_rows_linear(x, ws)


def test_few_rows_linear_refuses_autograd_and_autocast() -> None:
    """It has no backward: a weight that needs a gradient under grad mode is refused (not
    silently detached); under autocast the mixed-precision path owns the cast."""
    w = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    x = torch.randn(1, 8, device=DEVICE)
    assert not few_rows_linear_supported(x, [w])
    with torch.no_grad():
        assert few_rows_linear_supported(x, [w])
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            assert not few_rows_linear_supported(x, [w])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "K", "bias"), [((1, 1), 300, True), ((2, 8), 37, False), ((16,), 5, True)]
)
def test_few_rows_logsigmoid_linear_matches_float64(dtype, rows, K, bias) -> None:
    """The decode step's forget gate (CPU: interpreter) against ``F.logsigmoid(F.linear())``
    in float64 of the same operands, elementwise to 1e-4 relative (below float32's normal
    range, zero): logits from -150 to +100, among them 9 to 19, where ``log(1 + e)`` in float32
    is off by up to 1e-2 relative or rounds to 0; K not a multiple of the K tile; 26 outputs
    (column blocks that end inside the row)."""
    torch.manual_seed(K)
    logits = [-150, -60, -20, -5, -1, 0, 0.5, 2, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 25]
    logits += [40, 60, 80, 100, -3, 3]
    N = len(logits)
    x = torch.randn(*rows, K).to(DEVICE, dtype)
    scale = torch.tensor([1e-3, 0.1, 1.0] * 8 + [20.0, 60.0])[:, None]  # two wide logits
    w = (torch.randn(N, K) * scale / K**0.5).to(DEVICE)
    b = torch.tensor(logits, dtype=torch.float32, device=DEVICE) if bias else None
    y = few_rows_logsigmoid_linear(x, w, b)
    z = x.double() @ w.double().t() + (b.double() if bias else 0)
    want = F.logsigmoid(z)
    assert y.dtype == torch.float32 and y.shape == (*rows, N)
    tiny = torch.finfo(torch.float32).tiny  # GPUs flush subnormal exp() to 0
    assert ((y.double() - want).abs() <= 1e-4 * want.abs() + tiny).all()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: (torch.randn(17, 8), torch.randn(4, 8), None), "17 rows"),
        (lambda: (torch.randn(1, 8).double(), torch.randn(4, 8), None), "float64 x"),
        (lambda: (torch.randn(1, 8), torch.randn(4, 8).bfloat16(), None), "a 16-bit weight"),
        (lambda: (torch.randn(1, 8), torch.randn(8, 4).t(), None), "a transposed weight"),
        (lambda: (torch.randn(1, 8), torch.randn(4, 7), None), "K mismatch"),
        (lambda: (torch.randn(1, 8), torch.randn(4, 8), torch.randn(5)), "bias of 5 for 4 rows"),
        (lambda: (torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).half()), "16-bit bias"),
        (lambda: (torch.randn(3, 0), torch.randn(5, 0), None), "K = 0"),
    ],
)
def test_few_rows_logsigmoid_linear_refuses_what_it_does_not_take(make, why) -> None:
    x, w, b = (t.to(DEVICE) if t is not None else None for t in make())
    assert not few_rows_logsigmoid_linear_supported(x, w, b), why
    with pytest.raises(ValueError, match=r"use F\.logsigmoid\(F\.linear"):
        few_rows_logsigmoid_linear(x, w, b)


def test_few_rows_logsigmoid_linear_refuses_autograd() -> None:
    """It has no backward: a weight that needs a gradient under grad mode is refused (not
    silently detached); under no_grad (generate) it is taken."""
    w = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    x = torch.randn(1, 8, device=DEVICE)
    assert not few_rows_logsigmoid_linear_supported(x, w, None)
    with torch.no_grad():
        assert few_rows_logsigmoid_linear_supported(x, w, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests run them")
def test_few_row_kernels_compile_for_sm90_without_spills(tmp_path) -> None:
    """The decode step's few-row kernels, as the launchers call them on a GPU (bf16 rows,
    the GPU's K tiles; ``few_rows_linear`` also with float32 rows, as a float32 model's
    decode step runs it), compile for sm_90 with Triton's bundled ptxas, without register
    spills and within the shared memory of a block. (Tiles of 16 x 1024 needed 393,216 bytes
    at float32, and failed with ``OutOfResources`` on an H200 only.)"""
    from sm90_compile import assert_fits_shared, assert_no_spills, resource_usage

    from fot.kernels.linear_ops import GPU_TILES_FEW_ROWS, GPU_TILES_LOGSIGMOID

    (bn, bk), (gate_bn, gate_bk, gate_warps) = GPU_TILES_FEW_ROWS, GPU_TILES_LOGSIGMOID
    bf = "*bf16"
    weights = {f"W{i}": bf for i in range(8)}
    fp = "*fp32"
    jobs = [
        ("_few_rows_kernel", "_few_rows_kernel", {"X": bf, "Y": bf, **weights},
         {"NW": 8, "BM": 16, "BN": bn, "BK": bk, "DOT_PREC": "tf32"}, 4, ["stride_xm"],
         {"num_stages": 4}),
        ("_few_rows_kernel fp32", "_few_rows_kernel",
         {"X": fp, "Y": fp, **{w: fp for w in weights}},
         {"NW": 8, "BM": 16, "BN": bn, "BK": bk, "DOT_PREC": "ieee"}, 4, ["stride_xm"],
         {"num_stages": 4}),
        ("_few_rows_logsigmoid_kernel", "_few_rows_logsigmoid_kernel",
         {"X": bf, "W": "*fp32", "Bias": "*fp32", "Y": "*fp32"},
         {"HAS_BIAS": True, "BN": gate_bn, "BK": gate_bk}, gate_warps, ["stride_xm"]),
    ]  # fmt: skip
    usage = resource_usage("fot.kernels.linear_ops", jobs, tmp_path)
    assert set(usage) == {
        "_few_rows_kernel",
        "_few_rows_kernel fp32",
        "_few_rows_logsigmoid_kernel",
    }
    assert_no_spills(usage)
    assert_fits_shared(usage)
