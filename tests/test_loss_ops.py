"""Fused linear cross-entropy (``fot.kernels.linear_cross_entropy``) and the model's fused loss.

Oracle: ``F.cross_entropy(F.linear(hidden, weight[:n_classes]), labels, reduction="sum")`` in
float64 with autograd. Where the GEMMs run in bf16, the oracle starts from the same rounded
inputs and rounds the logits to bf16 as the kernel's GEMM does (a straight-through step, so the
gradients are those of the loss of the rounded logits). On CPU the Triton row kernel runs under
``TRITON_INTERPRET=1`` (set by conftest); the PyTorch path is tested by switching it off.

Tolerances (elementwise ``|got - want| <= RTOL * |want| + ATOL * max|want|``): float32 math, so
~1e-6 in float32; with bf16 GEMMs one bf16 rounding of the logits' gradient and of ``dx``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close

from fot.kernels import linear_cross_entropy, loss_ops

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16_STEP = 2.0**-8 if HAS_CUDA else 2.0**-7  # the interpreter truncates instead of rounding
IGNORE = -100


def make(N: int, H: int, V: int, n_classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 3  # logits of a few units
    labels = torch.randint(0, n_classes, (N,), generator=g)
    labels[::5] = IGNORE
    return hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE)


def oracle(hidden, weight, labels, n_classes, gemm_dtype, scale=1.0):
    """Summed loss and its gradients (hidden, weight) in float64."""
    x = hidden.detach().to(gemm_dtype).double().requires_grad_(True)
    w = weight.detach().to(gemm_dtype).double().requires_grad_(True)
    logits = F.linear(x, w[:n_classes])
    logits = logits + (logits.detach().to(gemm_dtype).double() - logits.detach())
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


def run(hidden, weight, labels, n_classes, chunk_rows, autocast=False, scale=1.0):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, w, labels, n_classes=n_classes, chunk_rows=chunk_rows)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


CASES = [
    # (hidden dtype, weight dtype, autocast, GEMM dtype)
    (torch.float32, torch.float32, False, torch.float32),
    (torch.bfloat16, torch.float32, True, torch.bfloat16),  # training: autocast, fp32 head
    (torch.bfloat16, torch.bfloat16, False, torch.bfloat16),  # bf16 weights
]


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "pytorch"])
@pytest.mark.parametrize("h_dtype,w_dtype,autocast,gemm_dtype", CASES)
def test_matches_float64_oracle(monkeypatch, kernel, h_dtype, w_dtype, autocast, gemm_dtype):
    """Loss and both gradients, with ignored rows, padding classes (V = 100, 90 real), chunks that
    do not divide the rows (37 rows by 16), vocab wider than the kernel's column step, and an
    incoming gradient of 3 (the backward scales the gradients computed in the forward)."""
    if not kernel:
        if HAS_CUDA:
            pytest.skip("the PyTorch path runs off CUDA only")
        monkeypatch.setattr(loss_ops, "_interpreting", lambda: False)
    hidden, weight, labels = make(37, 24, 100, 90)
    hidden, weight = hidden.to(h_dtype), weight.to(w_dtype)
    loss, dx, dw = run(hidden, weight, labels, 90, 16, autocast=autocast, scale=3.0)
    want_loss, want_dx, want_dw = oracle(hidden, weight, labels, 90, gemm_dtype, scale=3.0)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert dx.dtype == h_dtype and dw.dtype == w_dtype
    tol = (1e-5, 1e-6) if gemm_dtype == torch.float32 else (2 * BF16_STEP, 2e-3)
    assert_close(loss, want_loss, (1e-5, 0), "loss")
    assert_close(dx, want_dx, tol, "d hidden")
    assert_close(dw[:90], want_dw[:90], tol, "d weight")
    assert torch.count_nonzero(dw[90:]) == 0  # padding classes: exactly no gradient
    assert torch.count_nonzero(dx[::5]) == 0  # ignored rows: exactly no gradient


def test_no_grad_gives_the_same_loss_and_no_graph() -> None:
    hidden, weight, labels = make(20, 16, 70, 70, seed=1)
    with torch.no_grad():
        plain = linear_cross_entropy(hidden, weight, labels, chunk_rows=8)
    h = hidden.clone().requires_grad_(True)
    graphed = linear_cross_entropy(h, weight, labels, chunk_rows=8)
    assert plain.grad_fn is None and graphed.grad_fn is not None
    assert torch.equal(plain, graphed.detach())
    # only hidden requires grad: the weight's gradient is not computed
    (dx,) = torch.autograd.grad(graphed, h)
    assert_close(dx, oracle(hidden, weight, labels, 70, torch.float32)[1], (1e-5, 1e-6), "dx")


def test_all_ignored_and_out_of_range_labels() -> None:
    """Every row ignored: loss 0 and zero gradients. A label outside [0, n_classes) that is not
    the ignore index makes the loss NaN (visible to the trainer's check) instead of reading
    outside the row."""
    hidden, weight, labels = make(9, 16, 64, 60, seed=2)
    loss, dx, dw = run(hidden, weight, torch.full_like(labels, IGNORE), 60, 4)
    assert loss.item() == 0 and torch.count_nonzero(dx) == 0 and torch.count_nonzero(dw) == 0
    for bad in (60, 63, -1):  # a padding class, the last padding row, a negative label
        labels_bad = labels.clone()
        labels_bad[3] = bad
        with torch.no_grad():
            assert torch.isnan(linear_cross_entropy(hidden, weight, labels_bad, n_classes=60))


def test_bad_inputs_raise_clear_errors() -> None:
    hidden, weight, labels = make(6, 8, 32, 32, seed=3)
    with pytest.raises(TypeError, match="hidden must be a 2-D"):
        linear_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(TypeError, match="weight must be a 2-D"):
        linear_cross_entropy(hidden, weight.long(), labels)
    with pytest.raises(ValueError, match=r"weight must be \[V, 8\]"):
        linear_cross_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        linear_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match=r"labels must have shape \[6\]"):
        linear_cross_entropy(hidden, weight, labels[:4])
    with pytest.raises(ValueError, match=r"n_classes must be in \[1, 32\]"):
        linear_cross_entropy(hidden, weight, labels, n_classes=33)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        linear_cross_entropy(hidden, weight, labels, chunk_rows=0)
    # no silent truncation or bool-as-int: n_classes=2.5 was cut to 2, chunk_rows=True was 1
    with pytest.raises(ValueError, match=r"n_classes must be a positive int, got 2\.5"):
        linear_cross_entropy(hidden, weight, labels, n_classes=2.5)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int, got True"):
        linear_cross_entropy(hidden, weight, labels, chunk_rows=True)
    with pytest.raises(ValueError, match=r"ignore_index must be an int .* got -100.0"):
        linear_cross_entropy(hidden, weight, labels, ignore_index=-100.0)
    with pytest.raises(TypeError, match=r"labels must be an integer tensor .* got torch\.bool"):
        linear_cross_entropy(hidden, weight, labels > 3)
    ids = labels.clamp(min=0)  # no -100: uint8 cannot hold it
    for interpret in ("1", "0"):  # the Triton kernel, and PyTorch's gather (uint8 failed there)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", interpret)
            for dtype in (torch.uint8, torch.int32):
                torch.testing.assert_close(
                    linear_cross_entropy(hidden, weight, ids.to(dtype)),
                    linear_cross_entropy(hidden, weight, ids),
                    rtol=0,
                    atol=0,
                )
    import numpy as np  # NumPy integers are integers

    want = linear_cross_entropy(hidden, weight, labels, n_classes=32, chunk_rows=4)
    got = linear_cross_entropy(
        hidden, weight, labels, n_classes=np.int64(32), chunk_rows=np.int64(4)
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_model_fused_loss_equals_chunked_loss(autocast) -> None:
    """A tiny FoT (Pro) with a padded vocabulary (300 real tokens, head padded to 320): the
    fused loss gives the chunked loss's value and every parameter's gradient."""
    from fot import presets

    def build(loss_impl: str):
        torch.manual_seed(0)
        cfg = presets.config("fot_pro", "tiny", vocab_size=300, bos_token_id=None,
                             pad_vocab_multiple=64, loss_impl=loss_impl, loss_chunk_size=48)  # fmt: skip
        return presets.build_model(cfg).to(DEVICE)

    fused, chunked = build("fused"), build("chunked")
    chunked.load_state_dict(fused.state_dict())
    assert fused.lm_head.weight.shape[0] == 320
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 300, (2, 40), generator=g).to(DEVICE)
    y = torch.randint(0, 300, (2, 40), generator=g).to(DEVICE)
    y[:, :3] = IGNORE
    losses = []
    for m in (fused, chunked):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = m(x, shift_labels=y).loss
        loss.backward()
        losses.append(loss.detach())
    tol = (2e-2, 2e-2) if autocast else (1e-4, 1e-5)
    assert_close(losses[0], losses[1], (tol[0] / 10, 0), "loss")
    for (name, p), q in zip(fused.named_parameters(), chunked.parameters(), strict=True):
        assert_close(p.grad, q.grad, tol, name)
    assert torch.count_nonzero(fused.lm_head.weight.grad[300:]) == 0
