"""The pure-PyTorch reference against a dense textbook formula (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fot.kernels import forgetting_attention_decode_reference, forgetting_attention_reference


def dense_oracle(q, k, v, log_fgate, window=None):
    """O(T^2) float64 formula straight from the definition."""
    B, T, HQ, D = q.shape
    rep = HQ // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    c = log_fgate.double().cumsum(1)  # (B, T, HQ)
    out = torch.zeros(B, T, HQ, D, dtype=torch.float64)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        s = torch.einsum("bhd,bjhd->bhj", q[:, i].double(), k[:, lo : i + 1].double())
        s = s / math.sqrt(D) + (c[:, i, :, None] - c[:, lo : i + 1].transpose(1, 2))
        out[:, i] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v[:, lo : i + 1].double())
    return out


def rand_inputs(B, T, HQ, H, D, gate_mean, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    lf = F.logsigmoid(torch.randn(B, T, HQ, generator=g) + gate_mean)
    return q, k, v, lf


@pytest.mark.parametrize("gate_mean", [-2.0, 4.0])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_dense_formula(gate_mean, window):
    q, k, v, lf = rand_inputs(2, 23, 4, 2, 8, gate_mean)
    out = forgetting_attention_reference(q, k, v, lf, window_size=window, chunk_size=7)
    torch.testing.assert_close(out, dense_oracle(q, k, v, lf, window), rtol=1e-10, atol=1e-10)


def test_reference_gradients_match_dense_formula():
    q, k, v, lf = rand_inputs(1, 19, 2, 1, 4, 0.0, seed=1)
    lf = lf.double()
    args = [t.clone().requires_grad_() for t in (q, k, v, lf)]
    # The reference takes float32 gates; feed the float64 gate through a float32 cast.
    out = forgetting_attention_reference(*args[:3], args[3].float(), chunk_size=5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), args)
    args2 = [t.clone().requires_grad_() for t in (q, k, v, lf)]
    grads2 = torch.autograd.grad((dense_oracle(*args2[:3], args2[3].float()) * w).sum(), args2)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_packed_documents_equal_separate_sequences():
    q, k, v, lf = rand_inputs(1, 30, 2, 2, 8, 1.0, seed=2)
    cu = torch.tensor([0, 7, 7, 20, 30])
    packed = forgetting_attention_reference(q, k, v, lf, cu_seqlens=cu)
    for s, e in [(0, 7), (7, 20), (20, 30)]:
        alone = forgetting_attention_reference(q[:, s:e], k[:, s:e], v[:, s:e], lf[:, s:e])
        torch.testing.assert_close(packed[:, s:e], alone)


def test_decode_reference_equals_full_attention_rows():
    q, k, v, lf = rand_inputs(2, 16, 4, 2, 8, 2.0, seed=3)
    full = dense_oracle(q, k, v, lf)
    c = lf.double().cumsum(1)
    out = forgetting_attention_decode_reference(q[:, -3:], k, v, c[:, -3:], c)
    torch.testing.assert_close(out, full[:, -3:], rtol=1e-10, atol=1e-10)
    # Masking the first 4 keys equals attending to the sequence without them.
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, :4] = False
    out = forgetting_attention_decode_reference(q[:, -2:], k, v, c[:, -2:], c, key_mask=mask)
    expect = dense_oracle(q[:, 4:], k[:, 4:], v[:, 4:], lf[:, 4:])[:, -2:]
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lf_dtype=torch.float16), "log_fgate must be a float32"),
        (dict(HQ=3, H=2), "multiple of key/value heads"),
        (dict(lf_shape=(1, 8, 1)), "one gate per query head"),
        (dict(cu=[0, 3, 9]), "end at T=8"),
        (dict(B=2, cu=[0, 8]), "batch size 1"),
        (dict(window=0), "window_size must be a positive int"),
    ],
)
def test_bad_inputs_get_clear_errors(kwargs, match):
    B, HQ, H = kwargs.get("B", 1), kwargs.get("HQ", 2), kwargs.get("H", 2)
    q, k, v = torch.randn(B, 8, HQ, 4), torch.randn(B, 8, H, 4), torch.randn(B, 8, H, 4)
    lf = torch.zeros(
        kwargs.get("lf_shape", (B, 8, HQ)), dtype=kwargs.get("lf_dtype", torch.float32)
    )
    cu = torch.tensor(kwargs["cu"]) if "cu" in kwargs else None
    with pytest.raises((ValueError, TypeError), match=match):
        forgetting_attention_reference(q, k, v, lf, cu_seqlens=cu, window_size=kwargs.get("window"))


def test_reference_stays_float32_under_autocast():
    """Under autocast the reference's einsums ran in bfloat16 (scores rounded to 8 bits, the
    output ~4e-3 off the formula), although it promises float32 inside; the model's CPU path
    runs it under autocast with ``parallel.precision=bf16``. Oracle: the float64 formula."""
    q, k, v, lf = (t.float() for t in rand_inputs(1, 24, 2, 1, 16, 2.0, seed=4))
    q, k = 3 * q, 3 * k  # logits of a few units, as in a trained model
    want = dense_oracle(q, k, v, lf)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, lf)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = forgetting_attention_reference(*leaves, chunk_size=7)
        c = lf.double().cumsum(1)
        dec = forgetting_attention_decode_reference(q[:, -3:], k, v, c[:, -3:], c)
    assert out.dtype == dec.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec.double(), want[:, -3:], rtol=1e-5, atol=1e-5)
    w = torch.randn_like(want)
    grads = torch.autograd.grad((out.double() * w).sum(), leaves)
    args = [t.double().requires_grad_() for t in (q, k, v, lf)]
    want_grads = torch.autograd.grad((dense_oracle(*args) * w).sum(), args)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
