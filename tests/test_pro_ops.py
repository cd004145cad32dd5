"""Fused FoT (Pro) components (``fot.kernels.shift_norm`` / ``norm_gate``).

Oracle: the plain formulas in float64 with autograd, written here (the shift as a loop over
positions). On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set by conftest).

Tolerances (elementwise ``|got - want| <= RTOL * |want| + ATOL * max|want|``):

* float32: everything in float32, so ~1e-7 relative.
* bfloat16: inputs are bfloat16 values (exact in float64); each output and each input gradient
  is rounded to bfloat16 once (at most 2**-8 relative with round-to-nearest; 2**-7 under the
  interpreter, which truncates), plus float32 rounding inside. The weight gradient is
  accumulated and returned in float32.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from fot.kernels import norm_gate, pro_ops, shift_norm

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# Triton's interpreter converts float32 to bfloat16 by truncation (measured: 2.0255 -> 2.015625,
# where round-to-nearest and torch give 2.03125), so under it one rounding costs up to one whole
# bfloat16 step (2**-7 relative); compiled kernels round to nearest (half a step, 2**-8).
BF16_STEP = 2.0**-8 if HAS_CUDA else 2.0**-7
TOL = {  # (RTOL, ATOL relative to the tensor's largest value)
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (BF16_STEP, 1e-5),
}
DW_TOL = (1e-5, 1e-5)  # weight gradient: float32 reduction in both dtypes

# (B, T, H, D, reset): every T in {1, 5, 64, 130}, H in {1, 3}, D in {32, 64, 128}, B in {1, 2}
CASES = [
    (1, 1, 1, 32, True),
    (2, 5, 3, 64, True),
    (1, 64, 3, 128, True),
    (2, 130, 1, 32, True),
    (1, 130, 3, 64, False),
    (2, 64, 1, 128, False),
]
SHIFT_VARIANTS = ["shift+norm", "shift", "norm"]
GATE_VARIANTS = ["norm+gate", "gate", "norm"]


def random_reset(T: int, g: torch.Generator) -> torch.Tensor:
    reset = torch.rand(T, generator=g) < 0.15
    reset[0] = True  # a document starts at t = 0 (x_{-1} is 0 anyway)
    if T > 3:
        reset[T // 2] = True
    return reset


# ---------------------------------------------------------------------------------------
# float64 oracles
# ---------------------------------------------------------------------------------------


def shift_oracle(x, s, reset):
    out = []
    for t in range(x.shape[1]):
        starts = t == 0 or (reset is not None and bool(reset[t]))
        prev = torch.zeros_like(x[:, t]) if starts else x[:, t - 1]
        a = 1.0 / (1.0 + torch.exp(-s[:, t]))  # (B, H)
        out.append((1.0 - a[..., None]) * x[:, t] + a[..., None] * prev)
    return torch.stack(out, dim=1)


def rmsnorm_oracle(z, w, eps):
    return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps) * w


def shift_norm_oracle(x, s, w, reset, eps):
    z = shift_oracle(x, s, reset) if s is not None else x
    return rmsnorm_oracle(z, w, eps) if w is not None else z


def norm_gate_oracle(o, g, w, eps):
    y = rmsnorm_oracle(o, w, eps) if w is not None else o
    return y * (1.0 / (1.0 + torch.exp(-g))) if g is not None else y


def grads_vs_oracle(fn, oracle, inputs, kwargs, seed):
    """Output and input gradients of ``fn`` and of ``oracle`` (float64 copies of the inputs)
    for one random upstream gradient."""
    out = fn(*inputs, **kwargs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    leaves = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, leaves, dy)
    ref_in = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    ref_out = oracle(*ref_in, **kwargs)
    want = torch.autograd.grad(ref_out, [t for t in ref_in if t is not None], dy.double())
    return out, ref_out, got, want, dy


def shift_norm_vs_oracle(x, s, w, reset, seed):
    """:func:`grads_vs_oracle` of :func:`shift_norm` (eps 1e-6, ``reset``) and its float64
    oracle."""
    return grads_vs_oracle(
        lambda a, b, c, **kw: shift_norm(a, b, c, **kw),
        lambda a, b, c, **kw: shift_norm_oracle(a, b, c, kw["reset"], kw["eps"]),
        (x, s, w),
        {"eps": 1e-6, "reset": reset},
        seed=seed,
    )


def norm_gate_vs_oracle(o, g, w, seed):
    """:func:`grads_vs_oracle` of :func:`norm_gate` (eps 1e-6) and its float64 oracle."""
    return grads_vs_oracle(
        lambda a, b, c, **kw: norm_gate(a, b, c, **kw),
        lambda a, b, c, **kw: norm_gate_oracle(a, b, c, kw["eps"]),
        (o, g, w),
        {"eps": 1e-6},
        seed=seed,
    )


def shift_grad_scale(x, s, w, reset, eps, dy) -> float:
    """Scale of ``ds_t = a_t (1 - a_t) sum_D dz_t (x_{t-1} - x_t)``: the same sum of absolute
    terms. The norm's backward makes ``dz_t`` nearly orthogonal to ``z_t``, so the sum cancels
    (exactly, at a document start where z = (1 - a) x): its float32 rounding error scales
    with the terms, not with the result."""
    x, s = x.detach().double(), s.detach().double()
    z = shift_oracle(x, s, reset).requires_grad_()
    y = rmsnorm_oracle(z, w.detach().double(), eps) if w is not None else z
    (dz,) = torch.autograd.grad(y, z, dy.double())
    diff = shift_oracle(x, torch.full_like(s, 1e4), reset) - x  # x_{t-1} - x_t (a = 1)
    a = torch.sigmoid(s)
    return (a * (1 - a) * (dz * diff).abs().sum(-1)).max().item()


def make_shift_inputs(B, T, H, D, variant, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype).requires_grad_()
    s = None
    if "shift" in variant:  # spread logits: mixing weights from ~0.05 to ~0.95
        s = (2.0 * torch.randn(B, T, H, generator=g)).to(DEVICE, dtype).requires_grad_()
    w = None
    if "norm" in variant:
        w = (1.0 + 0.3 * torch.randn(H, D, generator=g)).to(DEVICE).requires_grad_()
    return x, s, w


# ---------------------------------------------------------------------------------------
# Kernels vs the float64 oracle
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", SHIFT_VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}{}".format(*c[:4], "r" * c[4]))
def test_shift_norm_matches_oracle(case, variant, dtype) -> None:
    B, T, H, D, with_reset = case
    x, s, w = make_shift_inputs(B, T, H, D, variant, dtype, seed=T * 7 + D)
    g = torch.Generator().manual_seed(T)
    reset = random_reset(T, g).to(DEVICE) if with_reset and s is not None else None
    y, want_y, got, want, dy = shift_norm_vs_oracle(x, s, w, reset, seed=3)
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, want_y, TOL[dtype], "y")
    names = ["dx"] + (["ds"] if s is not None else []) + (["dw"] if w is not None else [])
    for name, a, b in zip(names, got, want):
        tol = DW_TOL if name == "dw" else TOL[dtype]
        scale = shift_grad_scale(x, s, w, reset, 1e-6, dy) if name == "ds" else None
        assert_close(a, b, tol, name, scale)
    assert got[0].dtype == dtype
    if s is not None:
        assert got[1].dtype == s.dtype
    if w is not None:
        assert got[-1].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["shift+norm", "shift"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize(
    "case", [(2, 1, 3, 64, None), (1, 5, 2, 32, "at_0"), (2, 70, 3, 128, "later")]
)
def test_shift_norm_continues_from_prev(case, variant, grad, dtype) -> None:
    """``prev`` (a decode cache's last pre-shift k/v) is ``x_{-1}``: the output equals the
    float64 oracle over the sequence with ``prev`` put in front, minus its first row, a reset
    at ``t = 0`` included. Without autograd the kernel runs; with it, the PyTorch path, whose
    gradients (``prev``'s too) match the oracle's."""
    B, T, H, D, resets = case
    x, s, w = make_shift_inputs(B, T, H, D, variant, dtype, seed=T + D)
    g = torch.Generator().manual_seed(T)
    # head-major storage, as the cache keeps it: unit stride on D only
    prev = torch.randn(B, 2 * D, H, generator=g).to(DEVICE, dtype)[:, :D].transpose(1, 2)
    prev.requires_grad_(grad)
    reset = None
    if resets is not None:  # documents start at random positions, and at t = 0 or not
        reset = torch.rand(T, generator=g) < 0.3
        reset[0] = resets == "at_0"
        reset = reset.to(DEVICE)
    full_reset = None if reset is None else torch.cat([reset.new_ones(1), reset])
    with torch.set_grad_enabled(grad):
        y = shift_norm(x, s, w, eps=1e-6, reset=reset, prev=prev)
    ref_in = [t.detach().double().requires_grad_() for t in (x, s, prev)]
    wd = w.detach().double() if w is not None else None
    full = torch.cat([ref_in[2][:, None], ref_in[0]], dim=1)  # (B, T + 1, H, D)
    s_full = torch.cat([ref_in[1].new_zeros(B, 1, H), ref_in[1]], dim=1)
    want = shift_norm_oracle(full, s_full, wd, full_reset, 1e-6)[:, 1:]
    assert y.dtype == dtype and y.shape == (B, T, H, D)
    assert_close(y, want, TOL[dtype], "y")
    assert y.requires_grad == grad
    if grad:
        dy = torch.randn(y.shape, generator=g).to(y)
        got = torch.autograd.grad(y, (x, s, prev), dy)
        want_g = torch.autograd.grad(want, ref_in, dy.double())
        dy_full = torch.cat([dy.new_zeros(B, 1, H, D), dy], dim=1)
        ds_scale = shift_grad_scale(full, s_full, w, full_reset, 1e-6, dy_full)
        for name, a, b in zip(("dx", "ds", "dprev"), got, want_g):
            scale = ds_scale if name == "ds" else None
            assert_close(a, b, TOL[dtype], name, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", GATE_VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}D{}".format(*c[:4]))
def test_norm_gate_matches_oracle(case, variant, dtype) -> None:
    B, T, H, D, _ = case
    gen = torch.Generator().manual_seed(T * 5 + D)
    o = torch.randn(B, T, H, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    gl = None
    if "gate" in variant:
        gl = (2.0 * torch.randn(B, T, H, D, generator=gen)).to(DEVICE, dtype).requires_grad_()
    w = None
    if "norm" in variant:
        w = (1.0 + 0.3 * torch.randn(H, D, generator=gen)).to(DEVICE).requires_grad_()
    y, want_y, got, want, _ = norm_gate_vs_oracle(o, gl, w, seed=4)
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, want_y, TOL[dtype], "y")
    names = ["do"] + (["dg"] if gl is not None else []) + (["dw"] if w is not None else [])
    for name, a, b in zip(names, got, want):
        assert_close(a, b, DW_TOL if name == "dw" else TOL[dtype], name)
        if name != "dw":
            assert a.dtype == dtype


@pytest.mark.parametrize("fn", ["shift_norm", "norm_gate"])
def test_eps_is_the_callers(fn) -> None:
    """``eps`` reaches the forward and the backward kernels. The other tests use eps 1e-6 on
    unit-scale rows, where it moves the results by ~1e-6 relative (inside float32
    tolerance); the model's q/k norms take 1e-5. Here the rows' mean square is ~1e-5, so an
    eps other than the caller's moves y and every gradient by a large factor. Oracle: the
    float64 formulas with autograd."""
    B, T, H, D = 2, 70, 3, 64  # T: the shift backward's t + 1 rows cross a block edge
    eps = 1e-5
    g = torch.Generator().manual_seed(11)
    x = (3e-3 * torch.randn(B, T, H, D, generator=g)).to(DEVICE).requires_grad_()
    w = (1.0 + 0.3 * torch.randn(H, D, generator=g)).to(DEVICE).requires_grad_()
    if fn == "shift_norm":
        s = (2.0 * torch.randn(B, T, H, generator=g)).to(DEVICE).requires_grad_()
        reset = random_reset(T, g).to(DEVICE)
        y, want_y, got, want, dy = grads_vs_oracle(
            lambda a, b, c, **kw: shift_norm(a, b, c, **kw),
            lambda a, b, c, **kw: shift_norm_oracle(a, b, c, kw["reset"], kw["eps"]),
            (x, s, w), {"eps": eps, "reset": reset}, seed=5,
        )  # fmt: skip
        names = ("dx", "ds", "dw")
    else:
        gl = (2.0 * torch.randn(B, T, H, D, generator=g)).to(DEVICE).requires_grad_()
        y, want_y, got, want, dy = grads_vs_oracle(
            lambda a, b, c, **kw: norm_gate(a, b, c, **kw),
            lambda a, b, c, **kw: norm_gate_oracle(a, b, c, kw["eps"]),
            (x, gl, w), {"eps": eps}, seed=5,
        )  # fmt: skip
        names = ("do", "dg", "dw")
    assert_close(y, want_y, TOL[torch.float32], "y")
    for name, a, b in zip(names, got, want, strict=True):
        # ds: the sum over D cancels (see shift_grad_scale); its scale is the sum's terms
        scale = shift_grad_scale(x, s, w, reset, eps, dy) if name == "ds" else None
        assert_close(a, b, DW_TOL if name == "dw" else TOL[torch.float32], name, scale)


def test_gpu_block_sizes_strided_inputs_and_frozen_weight(monkeypatch) -> None:
    """The GPU tile heights (32 rows forward, 16 backward at D=128: forward and backward blocks
    differ, the t+1 recompute crosses many block edges), inputs that are strided views of
    fused projections, a non-contiguous upstream gradient, and a weight without grad."""
    monkeypatch.setattr(pro_ops, "_CONFIG_OVERRIDE", {"fwd_elems": 4096, "bwd_elems": 2048})
    B, T, H, D = 2, 70, 2, 128
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, T, 3, H, D, generator=g).to(DEVICE).requires_grad_()
    logits = (2 * torch.randn(B, T, 2 * H, generator=g)).to(DEVICE).requires_grad_()
    x, s = qkv[:, :, 1], logits[:, :, H:]  # strided views, unit stride on D
    w = (1.0 + 0.3 * torch.randn(H, D, generator=g)).to(DEVICE)  # no grad
    reset = random_reset(T, g).to(DEVICE)
    c = torch.randn(B, H, T, D, generator=g).to(DEVICE)
    y = shift_norm(x, s, w, reset=reset)
    (y.transpose(1, 2) * c).sum().backward()  # dy = c.transpose(1, 2): non-contiguous
    x64 = qkv.detach().double()[:, :, 1].requires_grad_()
    s64 = logits.detach().double()[:, :, H:].requires_grad_()
    want = shift_norm_oracle(x64, s64, w.double(), reset, 1e-6)
    (want.transpose(1, 2) * c.double()).sum().backward()
    assert_close(y, want, TOL[torch.float32], "y")
    assert_close(qkv.grad[:, :, 1], x64.grad, TOL[torch.float32], "dx")
    assert qkv.grad[:, :, [0, 2]].abs().max() == 0
    assert_close(logits.grad[:, :, H:], s64.grad, TOL[torch.float32], "ds")
    # norm_gate on the same block sizes, with o a transposed (B, H, T, D) attention output
    o = torch.randn(B, H, T, D, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()
    gl = torch.randn(B, T, H, D, generator=g).to(DEVICE).requires_grad_()
    wn = (1.0 + 0.3 * torch.randn(H, D, generator=g)).to(DEVICE).requires_grad_()
    y, want_y, got, want, _ = norm_gate_vs_oracle(o, gl, wn, seed=5)
    assert_close(y, want_y, TOL[torch.float32], "y")
    for name, a, b in zip(["do", "dg", "dw"], got, want):
        assert_close(a, b, DW_TOL if name == "dw" else TOL[torch.float32], name)


def test_pytorch_path_without_triton(monkeypatch) -> None:
    """Off CUDA without the interpreter the public functions run the same math in PyTorch."""
    if HAS_CUDA:
        pytest.skip("the PyTorch path is taken on CPU tensors only")
    monkeypatch.setattr(pro_ops, "_interpreting", lambda: False)
    called = []
    monkeypatch.setattr(pro_ops._ShiftNormFn, "apply", lambda *a: called.append(a))
    monkeypatch.setattr(pro_ops._NormGateFn, "apply", lambda *a: called.append(a))
    B, T, H, D = 2, 9, 3, 16
    x, s, w = make_shift_inputs(B, T, H, D, "shift+norm", torch.bfloat16, seed=1)
    reset = random_reset(T, torch.Generator().manual_seed(2))
    y, want_y, got, want, dy = shift_norm_vs_oracle(x, s, w, reset, seed=6)
    assert_close(y, want_y, TOL[torch.bfloat16], "y")
    scales = [None, shift_grad_scale(x, s, w, reset, 1e-6, dy), None]
    for name, a, b, scale in zip(["dx", "ds", "dw"], got, want, scales):
        assert_close(a, b, DW_TOL if name == "dw" else TOL[torch.bfloat16], name, scale)
    o = torch.randn(B, T, H, D, dtype=torch.float32)
    gl = torch.randn(B, T, H, D, dtype=torch.float32)
    assert_close(
        norm_gate(o, gl, w),
        norm_gate_oracle(o.double(), gl.double(), w.double(), 1e-6),
        TOL[torch.float32],
        "norm_gate",
    )
    assert not called


# ---------------------------------------------------------------------------------------
# Same semantics as the model's PyTorch composition
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_model_pytorch_composition(dtype) -> None:
    """``shift_norm``/``norm_gate`` against ``_shift_then_norm``/``token_shift``/
    ``FoTHeadRMSNorm``/``_norm_then_gate`` of the model. The composition rounds in between
    (``a``, the shifted value and the normalised value to the input dtype), so in bfloat16 the
    two differ by a few bfloat16 steps; in float32 they agree to float32 accuracy."""
    from fot.models.modeling_fot import (
        FoTHeadRMSNorm,
        _norm_then_gate,
        _shift_then_norm,
        token_shift,
    )

    B, T, H, D = 2, 33, 3, 32
    x, s, _ = make_shift_inputs(B, T, H, D, "shift", dtype, seed=8)
    norm = FoTHeadRMSNorm(H, D).to(DEVICE)
    with torch.no_grad():
        norm.weight.add_(
            0.3 * torch.randn(H, D, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        )
    reset = random_reset(T, torch.Generator().manual_seed(10)).to(DEVICE)
    o = torch.randn(B, T, H, D).to(DEVICE, dtype)
    gl = torch.randn(B, T, H, D).to(DEVICE, dtype)
    # a few bfloat16 steps: up to three roundings in the composition vs one here
    tol = TOL[torch.float32] if dtype == torch.float32 else (4 * 2.0**-8, 4 * 2.0**-8)
    with torch.no_grad():
        pairs = {
            "shift+norm": (
                shift_norm(x, s, norm.weight, eps=norm.eps, reset=reset),
                _shift_then_norm(x, s, None, reset, norm),
            ),
            "shift": (shift_norm(x, s, reset=reset), token_shift(x, s, None, reset)),
            "norm": (shift_norm(x, None, norm.weight, eps=norm.eps), norm(x)),
            "norm+gate": (
                norm_gate(o, gl, norm.weight, eps=norm.eps),
                _norm_then_gate(o, gl, norm),
            ),
            "gate": (norm_gate(o, gl), _norm_then_gate(o, gl, None)),
        }
    for name, (got, want) in pairs.items():
        assert got.dtype == want.dtype == dtype, name
        assert_close(got, want, tol, name)


# ---------------------------------------------------------------------------------------
# The model: fused path vs PyTorch path
# ---------------------------------------------------------------------------------------


def tiny_pro(**overrides) -> torch.nn.Module:
    """A one-layer tiny FoT (Pro) on the Triton attention backend, on DEVICE (vocabulary of
    300); the embedding's gradient passes back through every fused op's input gradient."""
    from fot import presets

    cfg = presets.config(
        "fot_pro",
        "tiny",
        vocab_size=300,
        bos_token_id=None,
        eos_token_id=None,
        attn_backend="triton",
        num_hidden_layers=1,
        **overrides,
    )
    return presets.build_model(cfg).to(DEVICE)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # shift + norm on K, shift on V, norm on Q, output norm + gate
        {"qk_norm": False, "use_output_norm": False},  # K shift only, output gate only
        {"use_k_shift": False, "use_v_shift": False, "use_output_gate": False},  # norms only
    ],
    ids=["pro", "shift_gate", "norms"],
)
def test_model_fused_equals_pytorch_path(monkeypatch, overrides) -> None:
    """A tiny FoT (Pro) with the fused Pro components equals the same model (same Triton
    attention) with the PyTorch composition: logits, loss and every parameter gradient, for
    plain batches and packed documents (the KV-shift resets at each document start)."""
    from fot.models import modeling_fot

    torch.manual_seed(0)
    model = tiny_pro(**overrides).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 300, (2, 40), generator=g), torch.randint(0, 300, (2, 40), generator=g)
    x, y = x.to(DEVICE), y.to(DEVICE)
    cu = torch.tensor([0, 13, 14, 40], dtype=torch.int32)

    calls = []
    real = modeling_fot._use_fused_pro

    def run(fused: bool):
        def spy(backend, t, head_dim):
            calls.append(fused)
            return fused and real(backend, t, head_dim)

        monkeypatch.setattr(modeling_fot, "_use_fused_pro", spy)
        model.zero_grad()
        out = model(x, shift_labels=y)
        packed = model(x[:1], shift_labels=y[:1], cu_seqlens=cu.to(DEVICE))
        (out.loss + packed.loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():  # logits (the training forward with labels returns only the loss)
            logits, packed_logits = model(x).logits, model(x[:1], cu_seqlens=cu.to(DEVICE)).logits
        return logits, packed_logits, out.loss.detach() + packed.loss.detach(), grads

    want = run(False)
    got = run(True)
    assert True in calls and False in calls
    assert real("triton", torch.empty(1, 1, 64), 32)  # the fused path was on in the second run
    assert (got[0] - want[0]).abs().max() < 2e-5
    assert (got[1] - want[1]).abs().max() < 2e-5
    assert abs(got[2] - want[2]) < 1e-5
    assert got[3].keys() == want[3].keys()
    for name, grad in want[3].items():
        assert torch.allclose(got[3][name], grad, atol=1e-5, rtol=1e-4), name


def test_model_fused_path_with_query_padding() -> None:
    """Left padding without a cache (the padded k/v are zeroed before the shift): the padded
    sequence's real positions equal the unpadded sequence, with the fused path on."""

    torch.manual_seed(0)
    model = tiny_pro().eval()
    x = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    padded = torch.cat([torch.zeros(1, 5, dtype=x.dtype, device=DEVICE), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 12)], dim=1).to(DEVICE)
    with torch.no_grad():
        want = model(x).logits
        got = model(padded, attention_mask=mask).logits[:, 5:]
    assert (got - want).abs().max() < 2e-5


# ---------------------------------------------------------------------------------------
# Compiled for a Hopper GPU (without one): catches what the interpreter lets through
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="with a GPU the other tests run the compiled kernels")
def test_kernels_compile_for_sm90_without_spills(tmp_path, monkeypatch) -> None:
    """The kernels with every feature on (bf16, D=128, the GPU tile heights) compile for sm_90
    with Triton's bundled ptxas, and use no local memory (no register spills)."""
    from sm90_compile import assert_no_spills, resource_usage

    monkeypatch.setattr(pro_ops, "_interpreting", lambda: False)  # the GPU tile heights
    (_, fwd_bt, fwd_warps), (_, bwd_bt, bwd_warps) = (
        pro_ops._launch(128, k) for k in ("fwd", "bwd")
    )
    assert fwd_warps == bwd_warps == 4
    bf = "*bf16"
    shift = {"D": 128, "BD": 128, "HAS_SHIFT": True, "HAS_NORM": True, "HAS_RESET": True}
    gate = {"D": 128, "BD": 128, "HAS_GATE": True, "HAS_NORM": True}
    # strides the JIT sees as multiples of 16 for D = 128 (not the shift logits' ss_*)
    div16 = ["sx_b", "sx_t", "sx_h", "sdy_b", "sdy_t", "sdy_h", "so_b", "so_t", "so_h", "sg_b",
             "sg_t", "sg_h"]  # fmt: skip
    jobs = [
        ("_shift_norm_fwd_kernel", {"X": bf, "S": bf, "W": "*fp32", "RESET": "*i8",
         "PREV": bf, "Y": bf}, {**shift, "BT": fwd_bt, "HAS_PREV": True}),
        ("_shift_norm_bwd_kernel", {"X": bf, "S": bf, "W": "*fp32", "RESET": "*i8", "DY": bf,
         "DX": bf, "DS": bf, "DW": "*fp32"}, {**shift, "BT": bwd_bt}),
        ("_norm_gate_fwd_kernel", {"OIN": bf, "G": bf, "W": "*fp32", "Y": bf},
         {**gate, "BT": fwd_bt}),
        ("_norm_gate_bwd_kernel", {"OIN": bf, "G": bf, "W": "*fp32", "DY": bf, "DO": bf,
         "DG": bf, "DW": "*fp32"}, {**gate, "BT": bwd_bt}),
    ]  # fmt: skip
    usage = resource_usage(
        "fot.kernels._pro_kernels",
        [(name, name, ptrs, consts, 4, div16) for name, ptrs, consts in jobs],
        tmp_path,
    )
    assert set(usage) == {name for name, _, _ in jobs}
    assert_no_spills(usage)


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors() -> None:
    x = torch.randn(1, 4, 2, 8, device=DEVICE)
    s = torch.randn(1, 4, 2, device=DEVICE)
    w = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"shift_logits must have shape \(1, 4, 2\)"):
        shift_norm(x, s[:, :3])
    with pytest.raises(ValueError, match=r"weight must have shape \(2, 8\)"):
        shift_norm(x, s, torch.ones(8, device=DEVICE))
    with pytest.raises(TypeError, match="reset must be a bool tensor"):
        shift_norm(x, s, reset=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"reset must have shape \[T\] = \(4,\)"):
        shift_norm(x, s, reset=torch.zeros(5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="needs shift_logits or weight"):
        shift_norm(x, None)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, H, D\]"):
        shift_norm(x.flatten(2), s)
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        shift_norm(x.double(), s)
    with pytest.raises(ValueError, match="head_dim 512 exceeds the supported maximum 256"):
        shift_norm(torch.randn(1, 2, 1, 512, device=DEVICE), None, torch.ones(1, 512))
    with pytest.raises(ValueError, match="eps must be a positive number"):
        shift_norm(x, s, w, eps=0.0)
    with pytest.raises(ValueError, match=r"gate_logits must have shape \(1, 4, 2, 8\)"):
        norm_gate(x, torch.randn(1, 4, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="needs gate_logits or weight"):
        norm_gate(x)
    with pytest.raises(TypeError, match="gate_logits must be a floating tensor"):
        norm_gate(x, torch.ones(1, 4, 2, 8, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("shape", [(1, 0, 2, 8), (0, 4, 2, 8), (1, 4, 0, 8), (1, 4, 2, 0)])
def test_empty_inputs_give_empty_differentiable_outputs(shape) -> None:
    """A zero B, T, H or D: an empty output that backward goes through, with empty gradients
    for every input (it had no grad_fn, and D=0 raised ZeroDivisionError in shift_norm)."""
    B, T, H, D = shape
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    s = torch.randn(B, T, H, device=DEVICE, requires_grad=True)
    g = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.ones(H, D, device=DEVICE, requires_grad=True)
    for y, inputs in ((shift_norm(x, s, w), (x, s, w)), (norm_gate(x, g, w), (x, g, w))):
        assert y.shape == shape
        grads = torch.autograd.grad(y.sum(), inputs)
        for grad, t in zip(grads, inputs, strict=True):
            assert grad.shape == t.shape and not grad.any()


# ---------------------------------------------------------------------------------------
# split_columns / ColumnGrads: the consumers' gradients written into one buffer
# ---------------------------------------------------------------------------------------


def _projection_consumers(y, use_buffer: bool, *, extra_use: bool = False):
    """A Pro attention block's use of one projection output: q (norm), k (shift + norm), v
    (shift), the output gate, and the two shift logits; plus, with ``extra_use``, a second
    consumer of k's columns and a plain PyTorch use of v's."""
    B, T, _ = y.shape
    H, D = 2, 32
    sizes = [H * D, H * D, H * D, H * D, H, H, 5]
    grads = None
    if use_buffer:
        parts, grads = pro_ops.split_columns(y, sizes)
    else:
        parts = y.split(sizes, dim=-1)
    q, k, v, g, ks, vs, _unused = parts
    q, k, v, g = (t.view(B, T, H, D) for t in (q, k, v, g))
    w = torch.linspace(0.5, 1.5, H * D, device=y.device).view(H, D)
    qn = shift_norm(q, None, w, grads=grads)
    kn = shift_norm(k, ks, w, grads=grads)
    vn = shift_norm(v, vs, None, grads=grads)
    o = norm_gate(qn + kn + vn, g, w, grads=grads)
    loss = (o.float() * torch.linspace(-1, 1, o.numel(), device=y.device).view_as(o)).sum()
    if extra_use:
        loss = loss + shift_norm(k, ks, None, grads=grads).float().square().sum()
        loss = loss + v.float().sin().sum()
    return loss


@pytest.mark.parametrize("extra_use", [False, True])
def test_split_columns_gradient_equals_autograd_split(extra_use, monkeypatch) -> None:
    """The projection output's gradient assembled in one buffer equals autograd's concatenation
    (same kernels), unused columns get zeros, every consumer of the Pro block wrote in
    place (claims counted), and a second consumer of the same columns got memory of its own."""
    g = torch.Generator().manual_seed(0)
    y0 = torch.randn(2, 9, 4 * 64 + 2 * 2 + 5, generator=g).to(DEVICE)
    claims = []
    real_claim = pro_ops.ColumnGrads.claim

    def spy(self, t):
        out = real_claim(self, t)
        claims.append(out is not None)
        return out

    monkeypatch.setattr(pro_ops.ColumnGrads, "claim", spy)
    grads_of = {}
    for use_buffer in (False, True):
        y = y0.clone().requires_grad_(True)
        _projection_consumers(y * 1.0, use_buffer, extra_use=extra_use).backward()
        grads_of[use_buffer] = y.grad
    # bitwise under the interpreter; compiled, the strided stores may change Triton's layouts
    # and with them the order of the float32 row sums (~1e-7): a missed or overwritten column
    # would be off by O(1)
    torch.testing.assert_close(grads_of[True], grads_of[False], rtol=1e-5, atol=1e-6)
    assert torch.all(grads_of[True][..., -5:] == 0)
    # q, k, ks, v, vs, g in place; the second consumer of k / ks gets fresh memory
    assert claims.count(True) == 6 and claims.count(False) == (2 if extra_use else 0)


def test_column_grads_claims_views_of_live_y_only() -> None:
    """Under activation checkpointing ``y`` is freed after the forward and the backward gets
    views of a recomputed copy, which may or may not land at ``y``'s old address. Claims go to
    views of the live ``y`` only, so the allocator's state never decides the kernels' path."""
    y = torch.randn(1, 4, 3 * 8, device=DEVICE)
    cols = pro_ops.ColumnGrads(y)
    view = y[..., 8:16]
    assert cols.claim(view) is not None  # a view of the live y
    storage = y.untyped_storage()
    # the same memory, seen through a tensor that is not y (as a recomputed copy at y's old
    # address would be) once y itself is gone
    twin = torch.empty(0, device=DEVICE).set_(storage, 16, (1, 4, 8), (96, 24, 1))  # cols 16:24
    del y, view
    assert twin.untyped_storage().data_ptr() == storage.data_ptr()
    assert cols.claim(twin) is None


def test_split_columns_retain_graph_and_errors() -> None:
    y = torch.randn(1, 4, 4 * 64 + 9, device=DEVICE, requires_grad=True)
    loss = _projection_consumers(y * 1.0, True)
    (first,) = torch.autograd.grad(loss, y, retain_graph=True)
    (second,) = torch.autograd.grad(loss, y)
    torch.testing.assert_close(second, first, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must sum to"):
        pro_ops.split_columns(y, [3, 4])
    with pytest.raises(ValueError, match="contiguous"):
        pro_ops.split_columns(y[:, ::2], [y.shape[-1]])


def test_batch_times_heads_beyond_the_grid_limit_takes_the_pytorch_path(monkeypatch) -> None:
    # The kernels' grid has B * H in its second dimension, which CUDA caps at 65535: beyond it
    # the same math runs in PyTorch. Oracle: float64 formulas (the limit lowered to 5 < 3 * 2).
    monkeypatch.setattr(pro_ops, "MAX_GRID_Y", 5)
    called = []
    monkeypatch.setattr(pro_ops._ShiftNormFn, "apply", lambda *a: called.append(a))
    monkeypatch.setattr(pro_ops._NormGateFn, "apply", lambda *a: called.append(a))
    x, s, w = make_shift_inputs(3, 9, 2, 16, "shift+norm", torch.float32, seed=1)
    reset = random_reset(9, torch.Generator().manual_seed(2)).to(DEVICE)
    y = shift_norm(x, s, w, reset=reset)
    assert_close(y, shift_norm_oracle(x, s, w, reset, 1e-6), TOL[torch.float32], "shift_norm")
    gl = torch.randn_like(x)
    assert_close(norm_gate(x, gl, w), norm_gate_oracle(x, gl, w, 1e-6), TOL[torch.float32], "ng")
    assert not called
