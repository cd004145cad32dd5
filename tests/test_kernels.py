"""Triton forgetting attention vs the float64 PyTorch reference (CPU: Triton interpreter).

Inputs are made on the CPU; the kernel runs on the GPU where there is one (results come back
to the CPU for the comparison), under the interpreter otherwise.

Every check draws fresh random inputs and compares the output and all four gradients
(q, k, v, log_fgate) with the reference by relative error (with a small absolute floor for a
tensor whose reference is ~0). NaN never passes. Inputs drawn from the global RNG depend on the
tests that ran before in the worker: a gradient that is exactly 0 (one key per query) is
compared with its rounding bound instead (test_a_query_that_sees_only_its_own_key).
"""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fot.kernels import (
    PruneStats,
    forgetting_attention,
    forgetting_attention_decode,
    forgetting_attention_decode_reference,
    forgetting_attention_reference,
)

# Named tolerances (relative L2 error vs the float64 reference).
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
ABS_FLOOR_RMS = 1e-2  # absolute floor (RMS) for tensors whose reference is ~0
WEAK, STRONG = 4.0, -2.0  # mean of the gate logits: weak decay (f ~ 0.98), strong (f ~ 0.12)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    a, b = a.double(), b.double()
    floor = ABS_FLOOR_RMS * b.numel() ** 0.5
    return ((a - b).norm() / (b.norm() + floor)).item()


def make_inputs(B, T, HQ, H, D, dtype=torch.float32, gate_mean=WEAK, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    q = torch.randn(B, T, HQ, D, generator=g).to(dtype)
    k = torch.randn(B, T, H, D, generator=g).to(dtype)
    v = torch.randn(B, T, H, D, generator=g).to(dtype)
    log_f = F.logsigmoid(torch.randn(B, T, HQ, generator=g) + gate_mean)
    return q, k, v, log_f


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def run_kernel(q, k, v, log_f, **kw):
    """The kernel on DEVICE; output on the CPU."""
    if isinstance(kw.get("cu_seqlens"), torch.Tensor):
        kw["cu_seqlens"] = kw["cu_seqlens"].to(DEVICE)
    return forgetting_attention(*on_device(q, k, v, log_f), **kw).cpu()


def kernel_and_grads(q, k, v, log_f, do, **kw):
    if isinstance(kw.get("cu_seqlens"), torch.Tensor):
        kw["cu_seqlens"] = kw["cu_seqlens"].to(DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in on_device(q, k, v, log_f)]
    o = forgetting_attention(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype).to(DEVICE))
    return o.detach().cpu(), [g.cpu() for g in grads]


def reference_and_grads(q, k, v, log_f, do, **kw):
    leaves = [q.double(), k.double(), v.double()]
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    lf = log_f.clone().requires_grad_(True)
    o = forgetting_attention_reference(*leaves, lf, **kw)
    grads = torch.autograd.grad(o, [*leaves, lf], do.double())
    return o.detach(), grads


def assert_matches_reference(q, k, v, log_f, tol, **kw):
    do = torch.randn(q.shape, dtype=torch.float32)
    o, grads = kernel_and_grads(q, k, v, log_f, do, **kw)
    kw.pop("prune", None)
    kw.pop("stats", None)
    o_ref, grads_ref = reference_and_grads(q, k, v, log_f, do, **kw)
    errs = {"o": rel_err(o, o_ref)}
    for name, a, b in zip(("dq", "dk", "dv", "dlogf"), grads, grads_ref):
        assert a.shape == b.shape and a.dtype == (log_f.dtype if name == "dlogf" else q.dtype)
        errs[name] = rel_err(a, b)
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative error above {tol}: {bad} (all: {errs})"
    return o, grads


@pytest.mark.parametrize(
    ("T", "D", "HQ", "H", "gate_mean", "dtype"),
    [
        (17, 64, 2, 2, STRONG, torch.float32),
        (64, 32, 4, 2, WEAK, torch.float32),
        (255, 64, 2, 1, STRONG, torch.float16),
        (300, 32, 2, 2, WEAK, torch.float16),
        (300, 64, 2, 2, STRONG, torch.float32),
    ],
)
def test_matches_reference(T, D, HQ, H, gate_mean, dtype):
    q, k, v, log_f = make_inputs(1, T, HQ, H, D, dtype, gate_mean)
    assert_matches_reference(q, k, v, log_f, TOL[dtype])


def test_batch_and_custom_scale():
    q, k, v, log_f = make_inputs(2, 70, 2, 1, 32, torch.float32, WEAK)
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32], scale=0.3)


# Window 66: the last query that sees a key tile's last key n (n + 65) starts a dK/dV query
# tile (tiles of 32 rows on the CPU, 64 on a GPU; n + 1 is a multiple of the key tile), so a
# row bound of the dK/dV kernel one short drops that row's share of dk, dv and dlogf.
@pytest.mark.parametrize(("window", "gate_mean"), [(40, WEAK), (33, STRONG), (66, WEAK)])
def test_sliding_window(window, gate_mean):
    q, k, v, log_f = make_inputs(1, 150, 2, 1, 32, torch.float32, gate_mean)
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32], window_size=window)


@pytest.mark.parametrize("prune", [False, True])
def test_window_near_the_int32_limit_is_no_window(prune):
    """A window of 2**31 - 1 (e.g. ``torch.iinfo(torch.int32).max`` as "no window") is the
    plain causal attention. The dK/dV kernel's last key + window overflowed int32: dk, dv and
    dlogf came out wrong without pruning, and with pruning its search read out of bounds
    (a segmentation fault under the interpreter)."""
    q, k, v, log_f = make_inputs(1, 100, 2, 1, 16, torch.float32, WEAK, seed=6)
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32], window_size=2**31 - 1, prune=prune)


@pytest.mark.parametrize(("T", "window"), [(150, 1), (1, None)])
def test_a_query_that_sees_only_its_own_key(T, window):
    """window_size=1, or a sequence of one token: o = v, and dq = dk = dlogf = 0 in exact
    arithmetic. In float32 the kernel's dS_jj = p_jj (do_j·v_j - do_j·o_j) is the difference of
    two dot products summed in different orders, so dq, dk and dlogf (the reverse cumsum of dS)
    are compared with the rounding bound of that difference, |dS_jj| <= 2 D eps sum_d
    |do_jd v_jd|, instead of by relative error (the reference is exactly 0: an absolute floor
    failed T=1 for about one draw in ten)."""
    HQ, H, D = 2, 1, 32
    group, scale = HQ // H, D**-0.5
    q, k, v, log_f = make_inputs(1, T, HQ, H, D, torch.float32, WEAK)
    do = torch.randn(q.shape)
    o, (dq, dk, dv, dlogf) = kernel_and_grads(q, k, v, log_f, do, window_size=window)
    o_ref, (_, _, dv_ref, dlogf_ref) = reference_and_grads(q, k, v, log_f, do, window_size=window)
    v_q = v.repeat_interleave(group, dim=2)  # (B, T, HQ, D): each query head's value
    assert rel_err(o, o_ref) <= TOL[torch.float32] and rel_err(o, v_q) <= TOL[torch.float32]
    assert rel_err(dv, dv_ref) <= TOL[torch.float32]
    assert not dlogf_ref.any()
    eps = torch.finfo(torch.float32).eps
    ds = 2 * D * eps * (do.abs() * v_q.abs()).sum(-1)  # (B, T, HQ): bound on |dS_jj|
    slack = 1.01  # the rounding of the products below
    dq_bound = slack * scale * ds[..., None] * k.repeat_interleave(group, dim=2).abs()
    dk_bound = slack * scale * (ds[..., None] * q.abs()).unflatten(2, (H, group)).sum(3)
    dlogf_bound = slack * ds.flip(1).cumsum(1).flip(1)  # dlogf_i sums dS_jj over j >= i
    for name, g, bound in (
        ("dq", dq, dq_bound),
        ("dk", dk, dk_bound),
        ("dlogf", dlogf, dlogf_bound),
    ):
        assert torch.isfinite(g).all() and (g.abs() <= bound).all(), name


def test_varlen_matches_loop_over_documents():
    # Boundaries off tile edges, an empty document and a length-1 document.
    cu = torch.tensor([0, 45, 45, 46, 130, 200], dtype=torch.int32)
    q, k, v, log_f = make_inputs(1, 200, 4, 2, 32, torch.float32, WEAK)
    do = torch.randn(q.shape)
    o, grads = kernel_and_grads(q, k, v, log_f, do, cu_seqlens=cu)
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        if e == s:
            continue
        sl = slice(s, e)
        o_doc, g_doc = kernel_and_grads(q[:, sl], k[:, sl], v[:, sl], log_f[:, sl], do[:, sl])
        assert rel_err(o[:, sl], o_doc) <= TOL[torch.float32]
        for a, b in zip(grads, g_doc):
            assert rel_err(a[:, sl], b) <= TOL[torch.float32]
    # ...and the whole packed call against the reference (also with a window).
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32], cu_seqlens=cu)
    assert_matches_reference(
        q, k, v, log_f, TOL[torch.float32], cu_seqlens=cu.long(), window_size=30
    )


@pytest.fixture
def unequal_tiles():
    """Tiles of different shapes (query tiles 64, key tiles 32 in forward/dQ; the reverse in
    dK/dV), so the unmasked interior tiles and the masked diagonal ones split differently."""
    fa = importlib.import_module("fot.kernels.forgetting_attention")

    fa._CONFIG_OVERRIDE.update(
        {"fwd_bm": 64, "fwd_bn": 32, "dq_bm": 64, "dq_bn": 32, "kv_bm": 32, "kv_bn": 64}
    )
    try:
        yield
    finally:
        fa._CONFIG_OVERRIDE.clear()


@pytest.mark.parametrize(
    ("T", "kw"),
    [(255, {}), (256, {}), (200, {"cu_seqlens": "docs"}), (255, {"window_size": 70})],
)
def test_unequal_tiles_match_reference(unequal_tiles, T, kw):
    q, k, v, log_f = make_inputs(1, T, 2, 1, 32, torch.float32, STRONG if kw else WEAK)
    if kw.get("cu_seqlens") == "docs":
        kw = {"cu_seqlens": torch.tensor([0, 45, 45, 46, 130, T], dtype=torch.int32)}
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32], **kw)


def test_tiles_that_split_a_query_tile_are_refused():
    fa = importlib.import_module("fot.kernels.forgetting_attention")

    fa._CONFIG_OVERRIDE.update({"fwd_bm": 32, "fwd_bn": 64})
    try:
        with pytest.raises(ValueError, match="fwd_bm=32 must be a multiple of fwd_bn=64"):
            run_kernel(*make_inputs(1, 8, 1, 1, 32))
    finally:
        fa._CONFIG_OVERRIDE.clear()


@pytest.mark.parametrize(
    ("T", "gate_mean", "window"),
    # Strong decay drops ~90 log2 units per 32-key tile, so a bound off by tens of units
    # would still prune only weightless tiles; at f ~ 0.73 (~15 per tile) it would not.
    # The third: one query past the first query tile (32 rows, GPU 128) and a window one
    # shorter than that tile, so that only the last, partial query tile can prune, and its
    # last padding row sees no key: its bound (+inf) must stay out of the tile's maximum
    # (it then pruned nothing; a loss of speed only).
    [
        (300, STRONG, None),
        (512 if DEVICE == "cpu" else 2048, 1.0, None),  # GPU: larger tiles
        (33 if DEVICE == "cpu" else 129, -150.0, 31 if DEVICE == "cpu" else 127),
    ],
)
def test_pruning_is_exact_and_skips_tiles(T, gate_mean, window):
    q, k, v, log_f = make_inputs(1, T, 2, 1, 32, torch.float32, gate_mean, seed=0)
    do = torch.randn(q.shape)
    stats = PruneStats()
    kw = {"window_size": window}
    o_on, g_on = kernel_and_grads(q, k, v, log_f, do, prune=True, stats=stats, **kw)
    off = PruneStats()
    o_off, g_off = kernel_and_grads(q, k, v, log_f, do, prune=False, stats=off, **kw)
    assert torch.equal(o_on, o_off)
    for a, b in zip(g_on, g_off):
        assert torch.equal(a, b)
    assert stats.tiles_total == off.tiles_total > 0
    assert off.tiles_skipped == 0
    assert 0 < stats.tiles_skipped < stats.tiles_total


def test_weak_decay_at_300_tokens_prunes_nothing():
    q, k, v, log_f = make_inputs(1, 300, 2, 1, 32, torch.float32, WEAK)
    weak = PruneStats()
    run_kernel(q, k, v, log_f, stats=weak)
    assert weak.tiles_skipped == 0


def test_pruning_is_exact_with_a_negative_scale():
    """With scale < 0 a score q.k * scale reaches up to |scale| |q| max|k|; the pruning bound
    took scale |q| max|k| (a large negative number) and skipped the key tiles that carry
    almost all the weight: output and gradients were silently wrong (prune is on by
    default). Here the first 32 keys score +200 |scale| against the queries from 32 on.

    Pruning on must equal pruning off bit for bit (no tile it skips carries weight). Against
    the float64 reference o, dq, dk and dv keep TOL, but d log f_t = sum_{i >= t > j} dS_ij
    cancels, and at scores this large float32 holds each p_ij = exp(s_ij - LSE_i) only to
    ~eps (|s_ij| + |LSE_i|). So d log f is compared with the first-order effect of those
    errors on top of TOL: the row's LSE error eps |LSE_i| scales its dS_ij alike (moving
    d log f_t by eps |LSE_i| |sum_{j < t} dS_ij|), and a score's error eps |s_ij| moves dS_ij by
    eps |s_ij| |dS_ij|. (By TOL alone d log f failed for 1 of 20 draws of dO, relative error
    1.3e-4. The bound adds up every pair's worst case: over those 20 draws the error stays 15
    to 62 times inside it, while an exclusive reverse cumsum in _dlogf_kernel is 170 times
    outside it.)"""
    T, D = 300, 16
    q, k, v, log_f = make_inputs(1, T, 2, 1, D, torch.float32, WEAK, seed=3)
    u = F.normalize(torch.randn(D, generator=torch.Generator().manual_seed(4)), dim=0)
    k[:, :32] += 10 * u
    q[:, 32:] -= 20 * u
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    o, grads = kernel_and_grads(q, k, v, log_f, do, scale=-1.0)
    o_off, grads_off = kernel_and_grads(q, k, v, log_f, do, scale=-1.0, prune=False)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dlogf"), (o, *grads), (o_off, *grads_off)):
        assert torch.equal(a, b), f"{name} differs with pruning on"
    o_ref, grads_ref = reference_and_grads(q, k, v, log_f, do, scale=-1.0)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads[:3]), (o_ref, *grads_ref[:3])):
        assert rel_err(a, b) <= TOL[torch.float32], name
    eps, causal = torch.finfo(torch.float32).eps, torch.ones(T, T, dtype=torch.bool).tril()
    bound = torch.zeros(T, 2, dtype=torch.float64)
    for h in range(2):  # dS in float64 from the reference's own quantities; GQA: one k/v head
        q1, do1, o1 = q[0, :, h].double(), do[0, :, h].double(), o_ref[0, :, h]
        k1, v1 = k[0, :, 0].double(), v[0, :, 0].double()
        c = log_f[0, :, h].double().cumsum(0)
        s = (-q1 @ k1.T + c[:, None] - c[None, :]).where(causal, -torch.inf)
        p, lse = s.softmax(-1), s.logsumexp(-1, keepdim=True)
        ds = p * (do1 @ v1.T - (do1 * o1).sum(-1, keepdim=True))
        pair = eps * s.where(causal, 0).abs() * ds.abs()
        for t in range(T):  # pairs i >= t > j
            rows = (eps * lse[t:, 0].abs() * ds[t:, :t].sum(-1).abs()).sum()
            bound[t, h] = rows + pair[t:, :t].sum()
    dlogf, dlogf_ref = grads[3][0].double(), grads_ref[3][0]
    err = (dlogf - dlogf_ref).norm()
    assert err <= TOL[torch.float32] * dlogf_ref.norm() + bound.norm(), (err, bound.norm())


def test_approximate_pruning_skips_more_and_stays_close():
    q, k, v, log_f = make_inputs(1, 300, 2, 1, 32, torch.float32, -0.5)
    exact, approx = PruneStats(), PruneStats()
    o_exact = run_kernel(q, k, v, log_f, stats=exact)
    o_approx = run_kernel(q, k, v, log_f, prune_threshold=-12.0, stats=approx)
    assert approx.tiles_skipped > exact.tiles_skipped
    # Dropped weights are below e^-12 of the row's largest in its query tile's key span each.
    assert rel_err(o_approx, o_exact) < 1e-3


def test_bfloat16_is_upcast_under_interpreter():
    q, k, v, log_f = make_inputs(1, 40, 2, 1, 32, torch.bfloat16, WEAK)
    o = run_kernel(q, k, v, log_f)
    assert o.dtype == torch.bfloat16
    o_ref = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f)
    assert rel_err(o, o_ref) < 1e-2  # bf16 output rounding only


def test_non_contiguous_inputs():
    q, k, v, log_f = make_inputs(1, 50, 2, 2, 32, torch.float32, WEAK)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not qt.is_contiguous()
    assert_matches_reference(qt, k, v, log_f, TOL[torch.float32])


# --- errors -------------------------------------------------------------------------------


def _ok(**over):
    q, k, v, log_f = make_inputs(1, 8, 2, 1, 32)
    args = {"q": q, "k": k, "v": v, "log_fgate": log_f}
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "kw", "exc", "match"),
    [
        ({"q": torch.randn(1, 8, 2, 48)}, {}, ValueError, "k/v shape"),
        (
            {
                "q": torch.randn(1, 8, 2, 48),
                "k": torch.randn(1, 8, 1, 48),
                "v": torch.randn(1, 8, 1, 48),
            },
            {},
            ValueError,
            "head_dim 48",
        ),
        (
            {
                "q": torch.randn(1, 8, 3, 32),
                "k": torch.randn(1, 8, 2, 32),
                "v": torch.randn(1, 8, 2, 32),
                "log_fgate": torch.zeros(1, 8, 3),
            },
            {},
            ValueError,
            "multiple",
        ),
        ({"log_fgate": torch.zeros(1, 8, 2, dtype=torch.float16)}, {}, TypeError, "float32"),
        ({"log_fgate": torch.zeros(1, 8, 1)}, {}, ValueError, "one gate per query head"),
        (
            {
                "q": torch.randn(1, 8, 2, 32).double(),
                "k": torch.randn(1, 8, 1, 32).double(),
                "v": torch.randn(1, 8, 1, 32).double(),
            },
            {},
            TypeError,
            "float64",
        ),
        ({}, {"window_size": 0}, ValueError, "window_size"),
        ({}, {"prune_threshold": 3.0}, ValueError, "negative"),
        ({}, {"prune": False, "prune_threshold": -5.0}, ValueError, "prune=True"),
        ({}, {"cu_seqlens": torch.tensor([0, 9])}, ValueError, "end at T=8"),
        ({}, {"cu_seqlens": torch.tensor([0.0, 8.0])}, ValueError, "int32/int64"),
        ({"log_fgate": torch.full((1, 8, 2), -torch.inf)}, {"debug": True}, ValueError, "finite"),
    ],
)
def test_bad_inputs_raise_clear_errors(over, kw, exc, match):
    args = _ok(**over)
    if "cu_seqlens" in kw:
        kw = {**kw, "debug": True}
    with pytest.raises(exc, match=match):
        run_kernel(args["q"], args["k"], args["v"], args["log_fgate"], **kw)


@pytest.mark.parametrize("fn", [forgetting_attention, forgetting_attention_reference])
@pytest.mark.parametrize(
    ("over", "kw", "exc", "match"),
    [
        (
            {"k": torch.randn(1, 8, 0, 32), "v": torch.randn(1, 8, 0, 32)},
            {},
            ValueError,
            "one key/value head",
        ),
        (
            {
                "q": torch.randn(1, 8, 2, 0),
                "k": torch.randn(1, 8, 1, 0),
                "v": torch.randn(1, 8, 1, 0),
            },
            {},
            ValueError,
            r"head_dim >= 1",
        ),
        ({"log_fgate": [0.0] * 8}, {}, TypeError, "log_fgate must be a float32 tensor"),
        ({}, {"cu_seqlens": [0, 8]}, TypeError, "cu_seqlens must be a 1-D int32/int64 tensor"),
    ],
)
def test_degenerate_shapes_and_non_tensors_raise_clear_errors(fn, over, kw, exc, match):
    """Zero kv heads or a zero head_dim, and a list where a tensor goes, get a one-line error
    from the kernel and the reference (they raised ZeroDivisionError / AttributeError)."""
    args = _ok(**over)
    with pytest.raises(exc, match=match):
        fn(args["q"], args["k"], args["v"], args["log_fgate"], **kw)


@pytest.mark.parametrize("fn", [run_kernel, forgetting_attention_reference])
def test_layout_mistakes_get_the_fix_in_the_error(fn):
    """q/k/v in SDPA's [B, heads, T, head_dim] layout with log f [B, T, heads] were told
    "log_fgate must have shape [B, T, HQ] = (1, 2, 8)": transposing log f as told ran the
    attention over the heads axis, silently. The errors now name the transposes (and the
    repeat for a gate per kv head, the decode function for fewer queries than keys);
    following them gives the dense formula."""
    from test_reference import dense_oracle

    q, k, v, log_f = make_inputs(1, 8, 4, 2, 16, seed=0)
    want = dense_oracle(q, k, v, log_f)
    sdpa = [t.transpose(1, 2) for t in (q, k, v)]  # [B, heads, T, D]
    with pytest.raises(ValueError, match=r"SDPA's \[B, heads, T, head_dim\]; for fewer"):
        fn(*sdpa, log_f)  # GQA: k has other "lengths" than q
    with pytest.raises(ValueError, match=r"if q is \[B, heads, T, head_dim\] \(SDPA's layout"):
        fn(sdpa[0], sdpa[0], sdpa[0], log_f)  # as many kv heads as query heads
    with pytest.raises(ValueError, match=r"log_fgate.transpose\(1, 2\)"):
        fn(q, k, v, log_f.transpose(1, 2))
    with pytest.raises(ValueError, match=r"log_fgate.repeat_interleave\(2, dim=2\)"):
        fn(q, k, v, log_f[:, :, ::2])  # a gate per kv head
    assert rel_err(fn(*(t.transpose(1, 2) for t in sdpa), log_f), want) < TOL[torch.float32]
    per_head = log_f[:, :, ::2].repeat_interleave(2, dim=2)
    assert rel_err(fn(q, k, v, per_head), dense_oracle(q, k, v, per_head)) < TOL[torch.float32]


@pytest.mark.parametrize("cu", [[0, 5], [1, 8], [0, 5, 3, 8], [0, 9]])
def test_malformed_cu_seqlens_on_the_cpu_is_refused_without_debug(cu):
    """Boundaries on the CPU are checked without ``debug`` (no device sync is needed); they
    gave a silently wrong result (the kernel attended across or past the bad boundaries)."""
    q, k, v, log_f = on_device(*make_inputs(1, 8, 2, 1, 32))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        forgetting_attention(q, k, v, log_f, cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def test_document_bounds_are_forced_into_range_and_order():
    """Each position's document bounds, as the kernels get them: for a well-formed
    ``cu_seqlens`` those of a loop over its documents; for a malformed one (unchecked on the GPU
    without ``debug``) those of its boundaries clamped into [0, T], the first set to 0, the last
    to T and each raised to the largest before it, so that start <= i < end <= T and both never
    decrease, which keeps the kernels' reads and writes inside the tensors."""
    fa = importlib.import_module("fot.kernels.forgetting_attention")
    T = 12

    def loop_bounds(cu):
        start = [s for s, e in itertools.pairwise(cu) for _ in range(s, e)]
        return start, [e for s, e in itertools.pairwise(cu) for _ in range(s, e)]

    cu = [0, 3, 3, 4, 9, 12]
    start, end = fa._doc_bounds(torch.tensor(cu, dtype=torch.int32), T, torch.device(DEVICE))
    assert start.dtype == end.dtype == torch.int32
    assert (start.tolist(), end.tolist()) == loop_bounds(cu)
    repaired = {
        (-5, 3, 8, 40): [0, 3, 8, 12],
        (0, 7, 2, 12): [0, 7, 7, 12],
        (5, 9): [0, 12],
        (0, 4): [0, 12],
        (-3, -1): [0, 12],
        (20, 30): [0, 12],
        (12, 0): [0, 12],
        (0, 20, 5, 3, 12): [0, 12, 12, 12, 12],
    }
    for bad, good in repaired.items():
        start, end = fa._doc_bounds(torch.tensor(bad), T, torch.device(DEVICE))
        assert (start.tolist(), end.tolist()) == loop_bounds(good), bad
    # Rows of several position blocks and boundary lists of several chunks (the kernel reads
    # 16 boundaries at a time for 32 positions per program in the interpreter): random
    # well-formed lists, and malformed ones repaired by hand in Python.
    gen = torch.Generator().manual_seed(0)
    T = 150
    # Many short documents, then one long one: later programs skip the short ones' boundaries
    # in wide chunks (32 in the interpreter, 1024 on a GPU), so its start comes from the skip.
    for good in ([*range(64), T], [*range(1024), 1100]):
        start, end = fa._doc_bounds(torch.tensor(good), good[-1], torch.device(DEVICE))
        assert (start.tolist(), end.tolist()) == loop_bounds(good), good[-3:]
    for n in (2, 5, 17, 40, 90):
        cuts = torch.randint(0, T + 1, (n - 2,), generator=gen).sort().values.tolist()
        good = [0, *cuts, T]
        start, end = fa._doc_bounds(torch.tensor(good), T, torch.device(DEVICE))
        assert (start.tolist(), end.tolist()) == loop_bounds(good), good
        bad = torch.randint(-30, T + 30, (n,), generator=gen).tolist()
        fixed = [min(max(b, 0), T) for b in bad]
        fixed[0], fixed[-1] = 0, T
        fixed = [max(fixed[: i + 1]) for i in range(n)]
        start, end = fa._doc_bounds(torch.tensor(bad), T, torch.device(DEVICE))
        assert (start.tolist(), end.tolist()) == loop_bounds(fixed), bad


def test_strided_cu_seqlens_is_read_by_its_values():
    """A ``cu_seqlens`` that is a strided view (every other entry of a longer tensor): the
    bounds kernel read its memory with stride 1, [0, 7, 5] for [0, 5, 10] here, and attended
    over the wrong documents (output off by 0.63 relative) though the checks saw the right
    values. It now gives the contiguous call's output and gradients bitwise."""
    q, k, v, log_f = make_inputs(1, 10, 2, 1, 16, torch.float32, WEAK)
    do = torch.randn(q.shape)
    strided = torch.tensor([0, 7, 5, 7, 10], dtype=torch.int32, device=DEVICE)[::2]
    assert not strided.is_contiguous() and strided.tolist() == [0, 5, 10]
    o, grads = kernel_and_grads(q, k, v, log_f, do, cu_seqlens=strided)
    o_good, grads_good = kernel_and_grads(q, k, v, log_f, do, cu_seqlens=strided.contiguous())
    assert torch.equal(o, o_good)
    for name, a, b in zip(("dq", "dk", "dv", "dlogf"), grads, grads_good):
        assert torch.equal(a, b), name


def test_dlogf_kernel_restarts_at_each_document():
    """The backward's d log f kernel against a float64 loop over documents, with the block
    size of the launch (32 in the interpreter; 4096 with 8 warps on a GPU, where this file's
    other rows fit one block): empty documents at the start, middle and end, a document of
    one position, one ending exactly at a block end, one spanning four blocks (the carried
    sum), a partial last block, and several batch rows and heads."""
    from fot.kernels import _triton_kernels as kern

    block, warps = (32, 1) if DEVICE == "cpu" else (4096, 8)
    T = 4 * block + 5
    cu = [0, 0, 0, 1, block, block, 2 * block - 3, T - 1, T, T]
    g = torch.Generator().manual_seed(0)
    B, HQ = 2, 3
    drow, dcol = torch.randn(2, B, HQ, T, generator=g)
    doc_end = torch.tensor([e for s, e in itertools.pairwise(cu) for _ in range(s, e)])
    want = torch.empty(B, T, HQ, dtype=torch.float64)
    dc = drow.double() - dcol.double()
    for s, e in itertools.pairwise(cu):
        want[:, s:e] = dc[..., s:e].flip(-1).cumsum(-1).flip(-1).transpose(1, 2)
    got = torch.full((B, T, HQ), float("nan"), device=DEVICE)
    drow, dcol, doc_end = on_device(drow, dcol, doc_end.int())
    kern._dlogf_kernel[(B * HQ,)](
        drow, dcol, doc_end, got, T, HQ, HAS_DOC=True, BLOCK=block, num_warps=warps
    )
    err = (got.cpu().double() - want).abs()
    assert (err <= 1e-6 * (1 + want.abs())).all(), err.max()


def test_unchecked_cu_seqlens_past_the_ends_attends_within_the_clamped_documents(monkeypatch):
    """A ``cu_seqlens`` starting below 0 and ending past T (not checked on the GPU without
    ``debug``: that needs a host sync) made the kernels read before q/k/v and the backward index
    past its buffer. It now gives exactly the call with the bounds clamped to [0, T], output and
    all four gradients bitwise. Off the GPU the check (which always runs there) is bypassed so
    that the kernels see the malformed boundaries as they would on a GPU."""
    if DEVICE == "cpu":
        fa = importlib.import_module("fot.kernels.forgetting_attention")
        check = fa.check_inputs
        monkeypatch.setattr(fa, "check_inputs", lambda *a, cu_seqlens=None, **kw: check(*a, **kw))
    q, k, v, log_f = make_inputs(1, 200, 4, 2, 32, torch.float32, WEAK)
    do = torch.randn(q.shape)
    bad = torch.tensor([-40, 70, 130, 260], dtype=torch.int32)
    good = torch.tensor([0, 70, 130, 200], dtype=torch.int32)
    o_bad, g_bad = kernel_and_grads(q, k, v, log_f, do, cu_seqlens=bad)
    o_good, g_good = kernel_and_grads(q, k, v, log_f, do, cu_seqlens=good)
    assert torch.equal(o_bad, o_good)
    for name, a, b in zip(("dq", "dk", "dv", "dlogf"), g_bad, g_good):
        assert torch.equal(a, b), name


def test_a_gate_above_one_turns_pruning_off_for_its_head_only():
    """A log f > 0 (a forget gate above 1) lets c rise, and pruning, which takes c to never
    rise, skipped key tiles that carry weight: in head 0 here c climbs by 310 over keys 1..31
    and drops by 300 at key 32, so the queries from 32 on weigh key 0 by e^10 while the bound
    (from the tile's last key) said e^-300. The output was off by 3.2 with no error on the
    GPU (off the GPU such a gate was refused). Now the gate cumsum kernel flags the head and
    nothing is pruned there, while head 1 (strong decay, the same key/value head) still is.
    Oracles: the float64 reference; the same call with ``prune=False``, bitwise; head 1 alone
    skips as many tiles as it does here, and head 0 alone skips none.

    Exactly up to the bias c_i - c_j, which the kernel forms with an error up to
    ~u (|c_i - a| + |c_j - a|) from its tile's anchor a (_triton_kernels.py). A non-increasing
    c keeps that below u |c_i - c_j|; this c rises by 310 inside one tile, so a pair's bias is
    off by up to delta = eps (max c - min c) = 3.7e-5 nats. o, dq, dk and dv keep relative
    errors ~1e-5, but d log f_t = sum_{i >= t > j} dS_ij cancels, so head 0's is compared with
    the first-order effect of that error on top of TOL: a bias error |delta_ij| <= delta moves
    dS_ij = p_ij (dp_ij - D_i) by at most 2 delta (|dS_ij| + p_ij sum_k |dS_ik|). (By TOL
    alone d log f failed for 18 of 200 draws of dO, relative error up to 3e-4; an exclusive
    instead of inclusive reverse cumsum in _dlogf_kernel is off by 0.33 against 5e-3.)"""
    T = 512  # 4 query tiles of the GPU's forward (128 rows), 16 of the interpreter's
    q, k, v, log_f = make_inputs(1, T, 2, 1, 32, gate_mean=STRONG, seed=0)
    log_f[0, :, 0] = 0.0
    log_f[0, 1:32, 0], log_f[0, 32, 0] = 10.0, -300.0
    do = torch.randn(q.shape)
    stats = PruneStats()
    o, grads = kernel_and_grads(q, k, v, log_f, do, stats=stats)  # prune=True, the default
    o_off, grads_off = kernel_and_grads(q, k, v, log_f, do, prune=False)
    for got, want in zip([o, *grads], [o_off, *grads_off], strict=True):
        assert torch.equal(got, want)
    alone = [PruneStats(), PruneStats()]
    for h in (0, 1):
        run_kernel(q[:, :, h : h + 1], k, v, log_f[:, :, h : h + 1], stats=alone[h])
    assert alone[0].tiles_skipped == 0
    assert 0 < alone[1].tiles_skipped == stats.tiles_skipped

    o_ref, grads_ref = reference_and_grads(q, k, v, log_f, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads[:3]), (o_ref, *grads_ref[:3])):
        assert rel_err(a, b) <= TOL[torch.float32], name
    assert rel_err(grads[3][..., 1], grads_ref[3][..., 1]) <= TOL[torch.float32]
    # Head 0's dS in float64 from the reference's own quantities.
    q1, k1, v1, do1, o1 = (t[0, :, 0].double() for t in (q, k, v, do, o_ref))
    c = log_f[0, :, 0].double().cumsum(0)
    s = 32**-0.5 * q1 @ k1.T + c[:, None] - c[None, :]
    p = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf).softmax(-1)
    ds = p * (do1 @ v1.T - (do1 * o1).sum(-1, keepdim=True))
    delta = torch.finfo(torch.float32).eps * (c.max() - c.min())
    moved = 2 * delta * (ds.abs() + p * ds.abs().sum(-1, keepdim=True))
    bound = torch.stack([moved[t:, :t].sum() for t in range(T)])  # pairs i >= t > j
    dlogf, dlogf_ref = grads[3][0, :, 0].double(), grads_ref[3][0, :, 0]
    assert (dlogf_ref - torch.stack([ds[t:, :t].sum() for t in range(T)])).abs().max() < 1e-6
    err = (dlogf - dlogf_ref).norm()
    assert err <= TOL[torch.float32] * dlogf_ref.norm() + bound.norm(), (err, bound.norm())


def test_debug_refuses_a_gate_that_is_not_finite():
    """``debug=True`` checks log f on any device (a host sync): NaN and -inf are refused,
    naming the count and the fix; a gate above 1 is not (the kernel computes it exactly)."""
    q, k, v, log_f = make_inputs(1, 64, 2, 1, 32, seed=0)
    for bad in (float("nan"), float("-inf")):
        poisoned = log_f.clone()
        poisoned[0, 3:5, 1] = bad
        with pytest.raises(ValueError, match=r"got 2 NaN or infinite entries; use F\.logsigmoid"):
            run_kernel(q, k, v, poisoned, debug=True)
    above = log_f.clone()
    above[0, 3, 1] = 0.5
    torch.testing.assert_close(run_kernel(q, k, v, above, debug=True), run_kernel(q, k, v, above))


def test_varlen_needs_batch_one():
    q, k, v, log_f = make_inputs(2, 8, 2, 1, 32)
    with pytest.raises(ValueError, match="batch size 1"):
        run_kernel(q, k, v, log_f, cu_seqlens=torch.tensor([0, 8]))


def test_cpu_without_interpreter_points_to_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, log_f = make_inputs(1, 8, 2, 1, 32)
    with pytest.raises(RuntimeError, match="forgetting_attention_reference"):
        forgetting_attention(q, k, v, log_f)


def test_triton_interpret_set_after_the_import_is_named_and_the_fused_ops_run_pytorch():
    """Triton reads TRITON_INTERPRET when it is imported: set afterwards (a notebook that
    imported fot.kernels first), the kernels were compiled for a GPU and every call on the CPU
    failed deep in Triton with "0 active drivers". Now forgetting_attention says what to do,
    and the fused ops with a PyTorch path take it (oracle: the formula)."""
    code = """if True:
        import os, torch, torch.nn.functional as F
        import fot.kernels as K
        os.environ["TRITON_INTERPRET"] = "1"
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(K.swiglu(x), F.silu(x[..., :8]) * x[..., 8:])
        q = torch.randn(1, 8, 2, 16)
        try:
            K.forgetting_attention(q, q, q, torch.zeros(1, 8, 2))
        except RuntimeError as err:
            print(err)
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")])
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRITON_INTERPRET=1 was set after triton was imported" in out.stdout, out.stdout


def _poison(q, k, log_f, bad):
    """Inputs with a NaN or inf where ``bad`` says (q, k and log_f are copied)."""
    q, k, log_f = q.clone(), k.clone(), log_f.clone()
    if bad == "nan_q_all":
        q.fill_(float("nan"))
    elif bad == "nan_q_row":
        q[0, 3, 1, 0] = float("nan")
    elif bad == "inf_k":
        k[0, 5, 0, :] = float("inf")
    elif bad == "nan_gate":
        log_f[0, 6, 1] = float("nan")
    return q, k, log_f


@pytest.mark.parametrize("T", [16, 40])
@pytest.mark.parametrize("bad", ["nan_q_all", "nan_q_row", "inf_k", "nan_gate"])
def test_nan_and_inf_inputs_come_out_nan_where_the_math_says(T, bad):
    """A NaN or inf in q, k or the gates must reach the output (a diverging run must not be
    hidden), in the same places in the kernel with and without pruning and in the reference.
    The oracle for where: the float64 dense formula, in which any NaN score or bias poisons
    its whole row (inf k: +inf and -inf scores, inf - inf)."""
    q, k, v, log_f = make_inputs(1, T, 2, 1, 16, torch.float32, STRONG, seed=5)
    q, k, log_f = _poison(q, k, log_f, bad)
    c = log_f.double().cumsum(1)
    scores = torch.einsum("bihd,bjd->bhij", q.double(), k[:, :, 0].double()) * 16**-0.5
    scores = scores + c.permute(0, 2, 1)[..., :, None] - c.permute(0, 2, 1)[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    expect = torch.einsum("bhij,bjd->bihd", probs, v[:, :, 0].double())
    nan_rows = expect.isnan()
    assert (nan_rows.any() and not nan_rows.all()) or bad == "nan_q_all"
    for name, out in [
        ("pruned", run_kernel(q, k, v, log_f, prune=True)),
        ("unpruned", run_kernel(q, k, v, log_f, prune=False)),
        ("reference", forgetting_attention_reference(q, k, v, log_f)),
    ]:
        assert torch.equal(out.isnan(), nan_rows), f"{name}: NaN in other places than the math"
        ok = ~nan_rows
        assert not ok.any() or rel_err(out[ok], expect[ok]) < TOL[torch.float32], name


@pytest.mark.parametrize(
    ("T", "where", "zero_queries"),
    [(128, ("k", 0), False), (128, ("v", 1), False), (128, ("v", 100), False),
     (40, ("k", 3), True)],
)  # fmt: skip
def test_exact_pruning_never_hides_a_nan_key_or_value(T, where, zero_queries):
    """Exact pruning promises the output of ``prune=False``, bitwise. A NaN key or value in a
    key tile that later query tiles prune reached no row after it (the key-norm bound dropped
    a NaN norm and never read v); and a last, partial query tile whose queries are all zero
    (bound 0 * inf) still pruned. The oracle: the same call with ``prune=False``."""
    q, k, v, log_f = make_inputs(1, T, 2, 1, 16, torch.float32, STRONG, seed=5)
    name, t = where
    (k if name == "k" else v)[0, t, 0, 1] = float("nan")
    if zero_queries:
        q[0, 32:] = 0.0
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    pruned, pruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=True)
    unpruned, unpruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=False)
    assert unpruned[0, -1].isnan().any()  # the last row reads the NaN (in a pruned tile)
    for got, want in zip([pruned, *pruned_grads], [unpruned, *unpruned_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("where", ["q", "do"])
def test_exact_pruning_never_hides_a_nan_query_or_output_gradient(where):
    """Without pruning, a NaN in q_i (hence O_i) or in dO_i makes dS_ij NaN for every key the
    backward pairs with row i (0 * NaN), so dK and dV come out NaN down to the first key. The
    backward's bound of such a row is NaN, which the max over the tile's rows skipped: the
    other rows' bound pruned the first key tile, whose dK/dV then stayed finite (prune=True is
    promised bitwise equal to prune=False). The oracle: the same call with ``prune=False``."""
    T = 128 if DEVICE == "cpu" else 512  # GPU: larger tiles
    q, k, v, log_f = make_inputs(1, T, 2, 1, 16, torch.float32, STRONG, seed=5)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    (q if where == "q" else do)[0, T - 28, 1, 0] = float("nan")
    stats = PruneStats()
    pruned, pruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=True, stats=stats)
    unpruned, unpruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=False)
    assert stats.tiles_skipped > 0  # the forward still prunes (the NaN stays in its row)
    assert unpruned_grads[1][0, 0].isnan().all()  # the first key's dK is NaN without pruning
    for got, want in zip([pruned, *pruned_grads], [unpruned, *unpruned_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_query_tile_that_needs_older_keys_than_later_tiles_gets_its_key_gradients():
    """With pruning, each dK/dV program binary-searches the query tiles that need its key
    tile, which holds only if the first key needed per query tile never falls from one tile
    to a later one: the launcher makes it so (a suffix minimum). Here the queries of one tile
    near the end are large (|q| 30 times the rest; a trained model's q norms vary too) and
    need the first keys, which the normal tiles before and after it prune: without the
    suffix minimum the search for the first key tile (CPU: query tiles of 32, the large ones
    the 7th of 8) stopped before it, and its share of dk, dv and dlogf was dropped. The
    large queries point along the first keys, so that those carry weight despite the decay.
    Oracles: the same call with ``prune=False`` (bitwise) and the float64 reference."""
    T, D = (256 if DEVICE == "cpu" else 1024), 32  # GPU: larger tiles
    q, k, v, log_f = make_inputs(1, T, 2, 1, D, torch.float32, STRONG, seed=7)
    u = F.normalize(torch.randn(D, generator=torch.Generator().manual_seed(8)), dim=0)
    k[:, :32] += 10 * u
    q[0, 3 * T // 4 : 3 * T // 4 + 32] = 200 * u  # in one query tile (of 32, GPU 64 or 128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    stats = PruneStats()
    pruned, pruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=True, stats=stats)
    unpruned, unpruned_grads = kernel_and_grads(q, k, v, log_f, do, prune=False)
    assert stats.tiles_skipped > 0  # the normal tiles prune
    for name, got, want in zip(("o", "dq", "dk", "dv", "dlogf"), [pruned, *pruned_grads],
                               [unpruned, *unpruned_grads], strict=True):  # fmt: skip
        assert torch.equal(got, want), f"{name} differs with pruning on"
    o_ref, grads_ref = reference_and_grads(q, k, v, log_f, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (pruned, *pruned_grads[:3]),
                          (o_ref, *grads_ref[:3]), strict=True):  # fmt: skip
        assert rel_err(a, b) <= TOL[torch.float32], name


def test_decode_gives_zero_for_a_query_with_no_key_and_nan_for_nan_input():
    """Prefill over a left-padded row: queries at padding positions see no key and give 0
    (not NaN); a NaN query still gives NaN, in the kernel path and in the reference."""
    B, T, HQ, H, D = 2, 12, 2, 1, 16
    q, kc, vc = torch.randn(B, T, HQ, D), torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, T, HQ) + 2.0), dim=1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :4] = False
    q[0, 7, 1, 2] = float("nan")
    for fn in (forgetting_attention_decode, forgetting_attention_decode_reference):
        out = fn(q, kc, vc, c, c, key_mask=mask)
        assert torch.equal(out[1, :4], torch.zeros(4, HQ, D)), fn.__name__
        nan = out.isnan()
        assert nan[0, 7, 1].all() and nan.sum() == D, fn.__name__
        alone = fn(q[1:, 4:], kc[1:, 4:], vc[1:, 4:], c[1:, 4:], c[1:, 4:])
        torch.testing.assert_close(out[1:, 4:], alone)


@pytest.mark.parametrize(("B", "T", "HQ"), [(1, 0, 2), (0, 5, 2), (1, 5, 0)])
def test_kernel_of_an_empty_input_is_empty_and_differentiable(B, T, HQ):
    """B, T or HQ of 0: an empty output that backward goes through like any other output,
    with empty gradients for all four inputs (it had no grad_fn: backward raised)."""
    q, k, v, log_f = make_inputs(B, T, HQ, 1, 16)
    do = torch.randn(q.shape)
    o, grads = kernel_and_grads(q, k, v, log_f, do)
    assert o.shape == q.shape and o.dtype == q.dtype
    for g, t in zip(grads, (q, k, v, log_f)):
        assert g.shape == t.shape and g.dtype == t.dtype


def _fused_case(name: str) -> tuple[object, list[torch.Tensor]]:
    """``(fn, inputs)`` of one fused function whose backward is a kernel (or saved gradients)."""
    from fot.kernels import (
        add_rms_norm,
        linear_cross_entropy,
        mixed_precision_linear,
        norm_gate,
        shift_norm,
        swiglu,
    )

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    if name == "forgetting_attention":
        return forgetting_attention, list(make_inputs(1, 16, 2, 1, 16, seed=0))
    if name == "swiglu":
        return swiglu, [r(3, 8)]
    if name == "add_rms_norm":
        return lambda x, res, w, pw: add_rms_norm(x, res, w, proj_weight=pw), [
            r(4, 16), r(4, 16), r(16), r(2, 16)
        ]  # fmt: skip
    if name == "shift_norm":
        return shift_norm, [r(1, 5, 2, 8), r(1, 5, 2), r(2, 8)]
    if name == "norm_gate":
        return norm_gate, [r(1, 5, 2, 8), r(1, 5, 2, 8), r(2, 8)]
    if name == "linear_cross_entropy":
        labels = torch.randint(0, 10, (6,), generator=g).to(DEVICE)
        return lambda h, w: linear_cross_entropy(h, w, labels), [r(6, 8), r(10, 8)]
    assert name == "mixed_precision_linear"
    return lambda x, w1, w2: mixed_precision_linear(x, [w1, w2], torch.bfloat16), [
        r(4, 8), r(3, 8), r(5, 8)
    ]  # fmt: skip


@pytest.mark.parametrize("loss", ["square", "linear"])
@pytest.mark.parametrize(
    "name",
    [
        "forgetting_attention",
        "swiglu",
        "add_rms_norm",
        "shift_norm",
        "norm_gate",
        "linear_cross_entropy",
        "mixed_precision_linear",
    ],
)
def test_a_second_order_gradient_through_a_fused_function_raises(name, loss):
    """Their backwards are kernels (or return gradients saved in the forward) without a
    graph: a gradient penalty through them silently lost the second order (the fused FoT
    model's penalty gradient was 100% off the reference's). PyTorch's once_differentiable,
    on forgetting_attention, missed a loss linear in the output (no error, no graph) and
    torch.autograd.grad(penalty, inputs) (second order zero). The create_graph=True backward
    now raises, naming the function and the PyTorch form that has a second order."""
    fn, inputs = _fused_case(name)
    inputs = [t.to(DEVICE).requires_grad_() for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    if loss == "square":
        total = sum(o.float().square().sum() for o in outs)
    else:
        total = sum(o.float().sum() for o in outs)
    with pytest.raises(RuntimeError, match=rf"^{name} is differentiable once: .*create_graph=True"):
        torch.autograd.grad(total, inputs, create_graph=True)
    grads = torch.autograd.grad(total, inputs)  # first order unchanged
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter only")
def test_torch_compile_of_a_caller_runs_the_interpreted_kernel_outside_the_graph():
    """Under torch.compile Dynamo traced into Triton's interpreter and failed ("KeyError:
    torch.uint64" from its numpy pointer arithmetic), with or without fullgraph. Now the call
    is a graph break; oracle: the same function run eagerly, output and gradients. (Dynamo
    traces as under any backend; aot_eager spares the C++ builds of Inductor's, ~30 s here.)"""

    def f(q, k, v, gate_logits):
        return forgetting_attention(2 * q, k, v, F.logsigmoid(gate_logits)).sin()

    q, k, v, _ = make_inputs(1, 40, 2, 1, 16, seed=0)
    gates = torch.randn(1, 40, 2)
    do = torch.randn(q.shape)
    results = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gates)]
        o = fn(*leaves)
        results.append([o, *torch.autograd.grad(o, leaves, do)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [-1, 0, 2.5])
def test_reference_refuses_a_chunk_size_that_is_not_a_positive_int(chunk_size):
    """chunk_size=-1 returned an empty [B, 0, HQ, D] output for a non-empty input; 0 and
    2.5 raised range()'s errors."""
    q, k, v, log_f = make_inputs(1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        forgetting_attention_reference(q, k, v, log_f, chunk_size=chunk_size)


def test_reference_of_an_empty_sequence_is_empty():
    q, k, v, log_f = make_inputs(1, 0, 2, 1, 16)
    for kw in ({}, {"cu_seqlens": torch.tensor([0, 0])}):
        out = forgetting_attention_reference(q, k, v, log_f, **kw)
        assert out.shape == (1, 0, 2, 16) and out.dtype == q.dtype


# --- decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(("Tq", "window", "use_mask"), [(1, None, False), (3, 20, True)])
def test_decode_matches_reference(Tq, window, use_mask):
    B, Tk, HQ, H, D = 2, 90, 4, 2, 32
    q = torch.randn(B, Tq, HQ, D)
    kc, vc = torch.randn(B, Tk, H, D), torch.randn(B, Tk, H, D)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ) + 2.0), dim=1) - 1000.0  # large |c|
    mask = None
    if use_mask:
        mask = torch.ones(B, Tk, dtype=torch.bool)
        mask[1, :30] = False  # left padding
    kw = {"window_size": window, "key_mask": mask}
    out = forgetting_attention_decode(q, kc, vc, c[:, -Tq:], c, **kw)
    ref = forgetting_attention_decode_reference(
        q.double(), kc.double(), vc.double(), c[:, -Tq:], c, **kw
    )
    assert rel_err(out, ref) < TOL[torch.float32]


def _decode_pytorch(q, kc, vc, cq, ck, *, window_size=None, key_mask=None):
    """The decode's PyTorch path (CPU without the interpreter, float64), called directly."""
    from fot.kernels import decode

    return decode._decode_pytorch(q, kc, vc, cq, ck, q.shape[-1] ** -0.5, window_size, key_mask)


@pytest.mark.parametrize("impl", ["kernel", "pytorch"])
@pytest.mark.parametrize(
    ("B", "Tq", "Tk", "HQ", "H", "D", "window", "dtype", "config"),
    [
        (2, 1, 300, 6, 2, 64, None, torch.float32, {}),  # GQA, one new token: the decode step
        (2, 1, 300, 6, 2, 64, None, torch.float32, {"block_n": 16, "splits": 7}),
        (1, 3, 257, 4, 4, 80, 40, torch.float32, {"block_n": 16, "splits": 3}),  # D not 2^k
        (2, 2, 96, 8, 1, 16, None, torch.float16, {"block_n": 16, "splits": 1}),
        (1, 70, 75, 2, 1, 32, 9, torch.float32, {"block_n": 16}),  # 140 rows: 3 row blocks
    ],
)
def test_decode_kernel_matches_reference(B, Tq, Tk, HQ, H, D, window, dtype, config, impl):
    """The split-K decode kernels (CPU: interpreter) and the PyTorch path against the float64
    reference: GQA, windows, left padding and a row whose every key is masked (zeros), keys
    split into spans of any count (the merge), head-major caches read through strided views
    (as FoTCache keeps them), more query rows than one block. Large |c|, as after a long
    prefill."""
    from fot.kernels import decode

    g = torch.Generator().manual_seed(Tk)
    q = torch.randn(B, Tq, HQ, D, generator=g).to(dtype)
    # head-major buffers with spare capacity, read as [B, Tk, H, D] views
    kbuf, vbuf = (torch.randn(B, H, Tk + 5, D, generator=g).to(dtype) for _ in range(2))
    kc, vc = kbuf[:, :, :Tk].transpose(1, 2), vbuf[:, :, :Tk].transpose(1, 2)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ, generator=g) + 2.0), 1) - 5000.0
    mask = torch.ones(B, Tk, dtype=torch.bool)
    mask[-1, : Tk // 3] = False  # left padding
    mask[0, Tk - (window or Tk) :] = False  # row 0's last query sees no key at all
    kw = {"window_size": window, "key_mask": mask}
    fn = forgetting_attention_decode if impl == "kernel" else _decode_pytorch
    decode._CONFIG_OVERRIDE.update(config)
    try:
        out = fn(q, kc, vc, c[:, -Tq:], c, **kw)
    finally:
        decode._CONFIG_OVERRIDE.clear()
    ref = forgetting_attention_decode_reference(
        q.double(), kc.double(), vc.double(), c[:, -Tq:], c, **kw
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out[0, -1], torch.zeros(HQ, D, dtype=dtype))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("impl", ["kernel", "pytorch"])
def test_decode_with_float64_cumsums_keeps_float32_accuracy_after_a_long_prefill(impl):
    """After ~32k tokens of strong decay |c| is ~4e4, where a float32 cumsum rounds c_i - c_j
    by ~4e-3 (helper-178: the cache kept float32 cumsums, and decode drifted by ~1e-3 from
    the float64 result). With float64 cumsums (as FoTCache keeps them) the kernel (CPU:
    interpreter) and the PyTorch path stay at float32 accuracy; float32 cumsums of the same
    |c| do not, which shows that the case tells the two apart."""
    g = torch.Generator().manual_seed(0)
    B, Tq, Tk, HQ, H, D = 1, 2, 200, 4, 2, 32
    q = torch.randn(B, Tq, HQ, D, generator=g)
    kc, vc = torch.randn(B, Tk, H, D, generator=g), torch.randn(B, Tk, H, D, generator=g)
    log_f = F.logsigmoid(torch.randn(B, Tk, HQ, generator=g, dtype=torch.float64) - 1.0)
    c = torch.cumsum(log_f, 1) - 46000.0  # where 32k tokens of log f ~ -1.4 leave it
    ref = forgetting_attention_decode_reference(q.double(), kc.double(), vc.double(), c[:, -Tq:], c)
    fn = forgetting_attention_decode if impl == "kernel" else _decode_pytorch

    def err(c):
        out = fn(q, kc, vc, c[:, -Tq:], c)
        return (out.double() - ref).abs().max().item()

    assert err(c) < 2e-6
    assert err(c.float()) > 1e-4
    if impl == "kernel":  # the Triton kernels take float64 cumsums (not the PyTorch fallback)
        from fot.kernels import decode

        assert decode._triton_ok(q, kc, vc, c[:, -Tq:], c)


@pytest.mark.parametrize("impl", ["kernel", "pytorch"])
def test_decode_takes_each_query_heads_own_cumsum(impl):
    """Heads decay at their own rates, so after a long prefill their cumsums lie far apart
    (here 4e4 between neighbouring query heads). A query row that read another head's c_i
    (a GQA index mix-up) is off by a constant per row, which the softmax would cancel in
    exact arithmetic, but its float32 scores of ~4e4 round by ~4e-3. Oracle: the float64
    reference, which pairs each query head with its own cumsum."""
    g = torch.Generator().manual_seed(1)
    B, Tq, Tk, HQ, H, D = 2, 3, 200, 6, 2, 32
    q = torch.randn(B, Tq, HQ, D, generator=g)
    kc, vc = torch.randn(B, Tk, H, D, generator=g), torch.randn(B, Tk, H, D, generator=g)
    log_f = F.logsigmoid(torch.randn(B, Tk, HQ, generator=g, dtype=torch.float64) - 1.0)
    c = torch.cumsum(log_f, 1) - 4e4 * torch.arange(HQ, dtype=torch.float64)
    fn = forgetting_attention_decode if impl == "kernel" else _decode_pytorch
    out = fn(q, kc, vc, c[:, -Tq:], c)
    ref = forgetting_attention_decode_reference(q.double(), kc.double(), vc.double(), c[:, -Tq:], c)
    assert (out.double() - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [("gate", "norm"), ("gate",), ("norm",)])
def test_decode_output_norm_and_gate_equal_norm_gate_after_it(dtype, parts, device):
    """``forgetting_attention_decode(..., gate=, norm_weight=)`` (the output norm and gate in
    the span-merging kernel; CPU: interpreter) gives ``norm_gate`` of the plain decode within
    one rounding of the dtype (the norm's sum may be reduced in another order), and the float64
    oracle within the decode's tolerance. GQA, D not a power of two, a strided gate (a column
    view of a projection), several key spans, a row that sees no key (zeros stay zeros); the
    PyTorch path (float64 inputs) applies the same epilogue."""
    from fot.kernels import decode, norm_gate

    g = torch.Generator().manual_seed(11)
    B, Tq, Tk, HQ, H, D = 2, 1, 200, 6, 2, 40

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = r(B, Tq, HQ, D)
    kbuf, vbuf = r(B, H, Tk + 3, D), r(B, H, Tk + 3, D)
    kc, vc = kbuf[:, :, :Tk].transpose(1, 2), vbuf[:, :, :Tk].transpose(1, 2)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ, generator=g) + 2.0), 1).to(device)
    mask = torch.ones(B, Tk, dtype=torch.bool, device=device)
    mask[0] = False  # row 0 sees no key
    proj = r(B, Tq, 2 * HQ * D)
    gate = proj[..., HQ * D :].view(B, Tq, HQ, D) if "gate" in parts else None
    weight = (1 + 0.3 * r(HQ, D)) if "norm" in parts else None
    kw = {"key_mask": mask}
    decode._CONFIG_OVERRIDE.update({"splits": 3, "block_n": 16})
    try:
        plain = forgetting_attention_decode(q, kc, vc, c[:, -Tq:], c, **kw)
        got = forgetting_attention_decode(
            q, kc, vc, c[:, -Tq:], c, gate=gate, norm_weight=weight, norm_eps=1e-3, **kw
        )
    finally:
        decode._CONFIG_OVERRIDE.clear()
    want = norm_gate(plain, gate, weight, eps=1e-3)
    eps = torch.finfo(dtype).eps
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=eps, atol=eps)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    o64 = forgetting_attention_decode_reference(
        q.double(), kc.double(), vc.double(), c[:, -Tq:], c, **kw
    )
    oracle = o64
    if weight is not None:
        oracle = oracle * torch.rsqrt(o64.pow(2).mean(-1, keepdim=True) + 1e-3) * weight.double()
    if gate is not None:
        oracle = oracle * torch.sigmoid(gate.double())
    assert rel_err(got[1], oracle[1]) < (TOL[dtype] if dtype == torch.float32 else 2e-2)
    # the PyTorch path (float64) applies the same epilogue
    q64, g64 = q.double(), gate.double() if gate is not None else None
    w64 = weight.double() if weight is not None else None
    got64 = forgetting_attention_decode(
        q64, kc.double(), vc.double(), c[:, -Tq:], c, gate=g64, norm_weight=w64, norm_eps=1e-3,
        **kw,
    )  # fmt: skip
    assert rel_err(got64[1], oracle[1]) < 1e-12
    with pytest.raises(ValueError, match=r"gate must have shape \(2, 1, 6, 40\) \(from q\)"):
        forgetting_attention_decode(q, kc, vc, c[:, -Tq:], c, gate=proj)


def test_decode_differentiates_where_autograd_needs_it():
    """With inputs that need gradients the decode takes its differentiable PyTorch path (a
    padded training batch attends through it): gradients of q, the caches and both cumsums
    as the float64 reference's. Without autograd the Triton kernels give the same output."""
    B, Tq, Tk, HQ, H, D = 2, 3, 40, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Tq, HQ, D, generator=g)
    kc, vc = torch.randn(B, Tk, H, D, generator=g), torch.randn(B, Tk, H, D, generator=g)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ, generator=g) + 2.0), 1)
    do = torch.randn(B, Tq, HQ, D, generator=g)
    mask = torch.ones(B, Tk, dtype=torch.bool)
    mask[1, :9] = False
    grads = []
    for fn, dt in (
        (forgetting_attention_decode, torch.float32),
        (forgetting_attention_decode_reference, torch.float64),
    ):
        ins = [t.to(dt).requires_grad_() for t in (q, kc, vc, c[:, -Tq:].clone(), c)]
        out = fn(*ins, key_mask=mask, window_size=30)
        grads.append(torch.autograd.grad((out * do.to(dt)).sum(), ins))
    for got, want in zip(*grads, strict=True):
        assert rel_err(got, want) < TOL[torch.float32]
    with torch.no_grad():
        plain = forgetting_attention_decode(q, kc, vc, c[:, -Tq:], c, key_mask=mask, window_size=30)
    ref = forgetting_attention_decode_reference(
        q.double(), kc.double(), vc.double(), c[:, -Tq:], c, key_mask=mask, window_size=30
    )
    assert not plain.requires_grad and rel_err(plain, ref) < TOL[torch.float32]


def test_decode_asks_autograd_on_every_call_and_keeps_no_input():
    """Whether the decode needs its differentiable path is decided per call, from the grad
    mode and the inputs of that call: the same tensors decoded first under ``no_grad`` (the
    kernels) and then with autograd on get gradients, and no input is kept alive afterwards
    (a prefill's q through a key mask is as large as the prompt)."""
    import gc
    import weakref

    B, Tq, Tk, HQ, H, D = 1, 2, 9, 2, 1, 16
    g = torch.Generator().manual_seed(8)
    ins = [
        torch.randn(B, Tq, HQ, D, generator=g),
        torch.randn(B, Tk, H, D, generator=g),
        torch.randn(B, Tk, H, D, generator=g),
    ]
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ, generator=g)), 1)
    ins = [t.requires_grad_() for t in (*ins, c[:, -Tq:].clone(), c)]
    with torch.no_grad():
        assert not forgetting_attention_decode(*ins).requires_grad
    out = forgetting_attention_decode(*ins)
    assert out.requires_grad  # not the kernels' answer of the no_grad call
    grads = torch.autograd.grad(out.sum(), ins)
    assert all(gr is not None and gr.abs().sum() > 0 for gr in grads[:3])
    refs = [weakref.ref(t) for t in ins]
    del ins, out, grads, c
    gc.collect()
    assert all(r() is None for r in refs)


def _decode_args(**over):
    B, Tq, Tk, HQ, H, D = 2, 2, 9, 4, 2, 16
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ)), dim=1)
    args = {
        "q": torch.randn(B, Tq, HQ, D),
        "k_cache": torch.randn(B, Tk, H, D),
        "v_cache": torch.randn(B, Tk, H, D),
        "q_cumsum": c[:, -Tq:],
        "k_cumsum": c,
    }
    kw = {k: over.pop(k) for k in ("window_size", "key_mask") if k in over}
    return {**args, **over}, kw


@pytest.mark.parametrize("fn", [forgetting_attention_decode, forgetting_attention_decode_reference])
@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"window_size": 0}, ValueError, "window_size must be a positive int"),
        ({"window_size": True}, ValueError, "window_size must be a positive int or None, got True"),
        (
            {"k_cache": torch.randn(2, 9, 0, 16), "v_cache": torch.randn(2, 9, 0, 16)},
            ValueError,
            "one key/value head",
        ),
        (
            {
                "q": torch.randn(2, 2, 4, 0),
                "k_cache": torch.randn(2, 9, 2, 0),
                "v_cache": torch.randn(2, 9, 2, 0),
            },
            ValueError,
            "head_dim >= 1",
        ),
        (
            {
                "q": torch.randn(2, 4, 2, 16),  # [B, heads, T, D]
                "k_cache": torch.randn(2, 2, 9, 16),
                "v_cache": torch.randn(2, 2, 9, 16),
            },
            ValueError,
            r"transpose\(1, 2\) tensors in SDPA's \[B, heads, T, head_dim\]",
        ),
        ({"q": torch.ones(2, 2, 4, 16, dtype=torch.long)}, TypeError, "q must be a floating"),
        ({"v_cache": torch.ones(2, 9, 2, 16, dtype=torch.int32)}, TypeError, "v_cache must be"),
        ({"q": [0.0]}, TypeError, "q must be a floating tensor"),
        ({"k_cumsum": torch.zeros(2, 9, 4, device="meta")}, ValueError, "one device"),
        (
            {"key_mask": torch.ones(2, 9, dtype=torch.bool, device="meta")},
            ValueError,
            "key_mask is on meta",
        ),
    ],
)
def test_decode_bad_inputs_raise_clear_errors(fn, over, exc, match):
    """The decode function and its reference refuse the same inputs with a one-line error
    (they raised ZeroDivisionError or torch's device errors from inside, returned an integer
    tensor for integer queries, and the reference gave zeros for window_size=0); tensors in
    SDPA's [B, heads, T, D] layout are told to transpose."""
    args, kw = _decode_args(**over)
    with pytest.raises(exc, match=match):
        fn(*args.values(), **kw)


def test_decode_launch_takes_small_programs_for_long_spans():
    """The span kernel's launch (``decode._span_launch``): spans fill 4 programs per SM of 4
    warps and 3 stages; where a span would still hold more than 32 key tiles at head dim
    <= 64, 6 programs per SM of 2 warps and 2 stages (hand-computed); the tuning dict
    overrides each part."""
    from fot.kernels import decode

    launch = decode._span_launch
    # 8 programs, 1000 keys: 16 tiles of 64, min(16, 32 // 8) = 4 spans of 4 tiles
    assert launch(8, 1000, 64, 8) == {"splits": 4, "block_n": 64, "warps": 4, "stages": 3}
    # 4 programs, 16384 keys: 256 tiles, 8 spans of 32 tiles: not more than 32
    assert launch(4, 16384, 64, 8) == {"splits": 8, "block_n": 64, "warps": 4, "stages": 3}
    # 8 programs: 4 spans of 64 tiles, so 6 * 8 // 8 = 6 spans of 2 warps and 2 stages
    assert launch(8, 16384, 64, 8) == {"splits": 6, "block_n": 64, "warps": 2, "stages": 2}
    assert launch(8, 16384, 32, 8)["warps"] == 2
    # head dim 128 (timed at 64 only): the 4-warp launch
    assert launch(8, 16384, 128, 8) == {"splits": 4, "block_n": 64, "warps": 4, "stages": 3}
    # 200 programs: 1 span of 256 tiles either way
    assert launch(200, 16384, 64, 8) == {"splits": 1, "block_n": 64, "warps": 2, "stages": 2}
    # the 760M model (24 heads) at 16k keys on an H100's 132 SMs, as docs/benchmarks.md timed
    # it: batch 1 and 2 keep 22 and 11 spans (12 and 24 tiles); batch 4 and 8 take 8 and 4
    want = {1: (22, 4, 3), 2: (11, 4, 3), 4: (8, 2, 2), 8: (4, 2, 2)}
    for batch, (splits, warps, stages) in want.items():
        got = launch(batch * 24, 16384, 64, 132)
        assert (got["splits"], got["warps"], got["stages"]) == (splits, warps, stages), batch
    decode._CONFIG_OVERRIDE.update({"splits": 3, "stages": 4})
    try:
        assert launch(8, 16384, 64, 8) == {"splits": 3, "block_n": 64, "warps": 2, "stages": 4}
    finally:
        decode._CONFIG_OVERRIDE.clear()


def test_decode_agrees_with_full_attention():
    q, k, v, log_f = make_inputs(1, 60, 4, 2, 32)
    full = forgetting_attention_reference(q, k, v, log_f)
    c = torch.cumsum(log_f.double(), dim=1)
    out = forgetting_attention_decode(q[:, -2:], k, v, c[:, -2:], c)
    assert rel_err(out, full[:, -2:]) < TOL[torch.float32]


def test_decode_stays_float32_under_autocast():
    """Under autocast the decode's float32 matmuls ran in bfloat16 (scores rounded to 8 bits,
    the output 0.04 off here), though it promises a float32 softmax; the decode reference
    under autocast is the oracle. A 16-bit cache is still read as it is: the same result as
    outside autocast."""
    B, Tq, Tk, HQ, H, D = 2, 3, 40, 4, 2, 32
    q = 3 * torch.randn(B, Tq, HQ, D)  # logits of a few units, as in a trained model
    kc, vc = torch.randn(B, Tk, H, D), torch.randn(B, Tk, H, D)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ) + 3.0), dim=1)
    args = (q, kc, vc, c[:, -Tq:], c)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = forgetting_attention_decode(*args)
        ref = forgetting_attention_decode_reference(*args)
        half = forgetting_attention_decode(q, kc.bfloat16(), vc.bfloat16(), c[:, -Tq:], c)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        half, forgetting_attention_decode(q, kc.bfloat16(), vc.bfloat16(), c[:, -Tq:], c),
        rtol=0, atol=0,
    )  # fmt: skip


def test_large_gate_cumsum_keeps_precision():
    # c reaches ~ -8.5e4 over the first 128 steps; the last 172 positions then attend among
    # themselves with weak decay. A plain float32 c (ulp ~8e-3 at 1e5) puts ~1e-2 errors
    # into every bias c_i - c_j (relative output error ~4.5e-4, measured); anchoring c per
    # tile keeps float32 accuracy. (The transition sits on a tile edge: the anchoring is
    # exact up to ~1e-7 x the spread of c inside one tile, see _triton_kernels.py.)
    q, k, v, _ = make_inputs(1, 300, 2, 1, 32, torch.float32)
    weak = F.logsigmoid(torch.randn(1, 172, 2) + 4)
    log_f = torch.cat([torch.full((1, 128, 2), -666.0), weak], 1)
    assert log_f.double().sum(1).min() < -8e4
    assert_matches_reference(q, k, v, log_f, TOL[torch.float32])


def test_gate_cumsum_kernel_matches_float64_cumsum():
    """The (hi, lo) float32 pair of the Triton scan is the float64 cumsum of log f in log2
    units, across several scan blocks and batch/head rows; its per-row flag says which rows
    hold a log f > 0 (one in the last, partial block; one the smallest positive float32)."""
    from fot.kernels import _triton_kernels as kern
    from fot.kernels.forgetting_attention import _gate_cumsum

    log_f = F.logsigmoid(torch.randn(2, 300, 3, generator=torch.Generator().manual_seed(0)) - 2)
    log_f[1, 299, 2] = 0.25
    log_f[0, 40, 1] = torch.finfo(torch.float32).smallest_normal
    log_f[1, 7, 0] = 0.0  # a gate of exactly 1 does not rise
    c, rises = _gate_cumsum(log_f.to(DEVICE))
    c = c.cpu()  # (B, HQ, 2, T)
    want = torch.cumsum(log_f.double().transpose(1, 2), -1) * kern.LOG2E
    got = c[:, :, 0].double() + c[:, :, 1].double()
    assert ((got - want).abs() / want.abs().clamp(min=1)).max() < 1e-13
    assert torch.equal(c[:, :, 0], want.float())  # hi is the float32 rounding
    assert rises.cpu().tolist() == [0, 1, 0, 0, 0, 1]  # (batch, head) rows in order


def test_key_norm_maximum_kernel_matches_torch():
    """The per-(batch, kv head) maximum key norm that bounds exact pruning, over several row
    blocks with a partial last block and strided keys, against torch's norm and max."""
    import triton

    from fot.kernels import _triton_kernels as kern

    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 75, 5, 32, generator=g) * torch.rand(2, 75, 5, 1, generator=g)
    k = k[:, :, 1:4]
    assert not k.is_contiguous()  # a slice of the heads: every stride but D's differs
    v = torch.randn(2, 75, 3, 32, generator=g).to(DEVICE)

    def kmax_of(k, v):
        kmax = torch.zeros(2, 3, device=DEVICE)
        kern._kmax_kernel[(triton.cdiv(75, 32), 2 * 3)](
            k, v, kmax, 75, 3, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), D=32, BT=32,
        )  # fmt: skip
        return kmax.cpu().double()

    k = k.to(DEVICE)
    want = torch.linalg.vector_norm(k.cpu().double(), dim=-1).amax(dim=1)
    assert ((kmax_of(k, v) - want).abs() / want).max() < 1e-6
    # a NaN or inf key or value: +inf for its (batch, head), so that nothing there is pruned
    for tensor, value in ((k, float("nan")), (v, float("nan")), (v, float("-inf"))):
        bad = tensor.clone()
        bad[1, 40, 2, 7] = value
        got = kmax_of(bad, v) if tensor is k else kmax_of(k, bad)
        other = torch.ones_like(got, dtype=torch.bool)
        other[1, 2] = False
        assert got[1, 2] == float("inf"), (value, got)
        assert ((got[other] - want[other]).abs() / want[other]).max() < 1e-6, (value, got)


def test_d64_backward_launch_caps_registers_for_three_programs_per_sm(tmp_path, monkeypatch):
    """At D=64 the dQ and dK/dV kernels launch with 4 warps and ``maxnreg=168``: compiled for
    sm_90 with those options (Triton's bundled ptxas) they use at most 168 registers per
    thread, so three programs fit in an SM's 65536 registers (uncapped, the dK/dV kernel takes
    ~200 to 255 depending on the Triton version)."""
    import re

    from sm90_compile import resource_usage

    fa = importlib.import_module("fot.kernels.forgetting_attention")
    monkeypatch.setattr(fa, "_interpreting", lambda: False)  # the GPU launch options
    launch, tiles = fa._launch_params(64), fa._tile_sizes(64)
    assert fa._launch_params(128)["kv"].get("maxnreg") is None  # D=128 keeps its 8 warps
    f32, bf = "*fp32", "*bf16"
    common = {"D": 64, "HAS_DOC": False, "HAS_WINDOW": False, "PRUNE": True, "EVEN": True}
    common["DOT_PREC"] = "tf32"
    scalars = {"qk_scale": "fp32", "scale": "fp32", "prune_log2": "fp32"}
    ints = {n: "*i32" for n in ("DOCSTART", "DOCEND", "KF", "KFIRST", "RISES")}
    floats = {n: f32 for n in ("C", "LSE", "DELTA", "LOLSE", "DCOL", "DROW", "KMAX", "Out")}
    vecs = {n: bf for n in ("Q", "K", "V", "DO", "DQ", "DK", "DV")}
    ptrs = {**vecs, **floats, **ints, **scalars}
    # 16-aligned strides (the JIT marks them so; the head stride too, or q and dO would load
    # as scalars): D=64 heads side by side
    tensors = ("q", "k", "v", "do", "o", "dq", "dk", "dv")
    div16 = [f"stride_{t}{a}" for t in tensors for a in "bth"]
    jobs = []
    for name, fn, consts in [
        ("dq", "_bwd_dq_kernel", {"BM": tiles["dq_bm"], "BN": tiles["dq_bn"]}),
        ("kv", "_bwd_dkdv_kernel", {"BM": tiles["kv_bm"], "BN": tiles["kv_bn"], "DQ_BM": 64}),
    ]:
        opts = dict(launch[name])
        assert opts.pop("num_warps") == 4 and opts["maxnreg"] == 168
        jobs.append((name, fn, ptrs, {**common, **consts}, 4, div16, opts))
    usage = resource_usage("fot.kernels._triton_kernels", jobs, tmp_path)
    for name, line in usage.items():
        regs = int(re.search(r"REG:(\d+)", line).group(1))
        assert regs <= 168, f"{name}: {line}"
        assert 3 * 4 * 32 * regs <= 65536


def test_document_kernels_compile_for_sm90_without_spills(tmp_path):
    """The per-position document bounds and the per-document d log f kernels (a segmented
    float64 scan over 4096 positions with 8 warps) compile for sm_90 with the launch options
    of a GPU run, without spilling registers (the interpreter runs neither through ptxas)."""
    from sm90_compile import assert_no_spills, resource_usage

    i32, f32 = "*i32", "*fp32"
    jobs = [
        ("bounds", "_doc_bounds_kernel", {"CU": i32, "START": i32, "END": i32},
         {"BLOCK_T": 128, "BLOCK_C": 32, "BLOCK_S": 1024}, 4, []),
        ("bounds64", "_doc_bounds_kernel", {"CU": "*i64", "START": i32, "END": i32},
         {"BLOCK_T": 128, "BLOCK_C": 32, "BLOCK_S": 1024}, 4, []),
        ("dlogf", "_dlogf_kernel", {"DROW": f32, "DCOL": f32, "DOCEND": i32, "DLOGF": f32},
         {"HAS_DOC": True, "BLOCK": 4096}, 8, []),
    ]  # fmt: skip
    usage = resource_usage("fot.kernels._triton_kernels", jobs, tmp_path)
    assert sorted(usage) == ["bounds", "bounds64", "dlogf"]
    assert_no_spills(usage)


def test_decode_step_kernels_compile_for_sm90_without_spills(tmp_path):
    """A static decode step's kernels with every part on, at the 760M shape (24 heads of 64,
    bf16): the cache write with KV-shift, q/k norms and its barrier, the span kernel at both
    of its launches (batch 1: 4 warps, 3 stages; batch 8: 2 warps, 2 stages) and the span
    merge with the output norm and gate, compile for sm_90 without spilling registers and
    within the shared memory of a block (the interpreter runs none of them through ptxas).
    The 2-warp launch may use up to 64 bytes of stack: it was timed fastest at batch 8 with
    56 bytes under Triton 3.6 (40 under 3.7); more would be a change to time again."""
    from sm90_compile import assert_fits_shared, assert_no_spills, resource_usage

    from fot.kernels import decode

    bf, f32 = "*bf16", "*fp32"
    append_ptrs = {n: bf for n in ("KN", "VN", "KB", "VB", "KP", "VP", "KS", "VS", "KL", "VL")}
    append_ptrs |= {"KW": bf, "Q": bf, "QW": bf, "QO": bf, "LF": f32, "CB": f32, "COUT": f32}
    append_ptrs |= {"POS": "*i64", "k_eps": "fp32", "q_eps": "fp32"}
    parts = ("K_SHIFT", "V_SHIFT", "K_MIX", "K_NORM", "V_MIX", "Q_NORM")
    jobs = [
        ("append", "_append_kernel", append_ptrs,
         {"D": 64, "DV": 64, "BH": 32, "BD": 64, "BDV": 64, "BQ": 32, **dict.fromkeys(parts, True)},
         4, []),
        ("merge", "_decode_merge_kernel", {"ACC": f32, "ML": f32, "Out": bf, "G": bf, "W": bf},
         {"D": 64, "BD": 64, "BS": 32, "HAS_NORM": True, "HAS_GATE": True}, 4, []),
    ]  # fmt: skip
    span_ptrs = {"Q": bf, "K": bf, "V": bf, "CQ": f32, "CK": f32, "KMASK": "*u8", "ACC": f32,
                 "ML": f32, "qk_scale": "fp32"}  # fmt: skip
    for batch in (1, 8):  # 24 heads of one row block each, on the 132 SMs of an H100
        launch = decode._span_launch(batch * 24, 16384, 64, 132)
        span_consts = {"D": 64, "BD": 64, "BM": 16, "BN": launch["block_n"], "HAS_MASK": True,
                       "HAS_WINDOW": False, "DOT_PREC": "tf32"}  # fmt: skip
        jobs.append((f"span {launch['warps']}", "_decode_span_kernel", span_ptrs, span_consts,
                     launch["warps"], [], {"num_stages": launch["stages"]}))  # fmt: skip
    usage = resource_usage("fot.kernels.decode", jobs, tmp_path)
    assert sorted(usage) == ["append", "merge", "span 2", "span 4"]
    assert_fits_shared(usage)  # every kernel, the 2-warp launch included
    stack = int(usage.pop("span 2").split("STACK:")[1].split()[0])
    assert 0 <= stack <= 64, stack
    assert_no_spills(usage)


def test_batches_beyond_the_grid_limit_run_in_parts(monkeypatch) -> None:
    # CUDA caps a grid's second dimension (B * heads) at 65535: a large evaluation batch of
    # short sequences failed to launch. Rows are independent, so the batch runs in parts.
    # Oracle: the same call in one part (the limit lowered to 8 = two rows of 4 heads).
    fa = importlib.import_module("fot.kernels.forgetting_attention")
    q, k, v, log_f = make_inputs(5, 16, 4, 2, 16, seed=3)
    do = torch.randn_like(q)
    want, want_grads = kernel_and_grads(q, k, v, log_f, do, window_size=6)
    launches = []
    apply = fa._ForgettingAttentionFn.apply
    monkeypatch.setattr(fa, "MAX_GRID_Y", 8)
    monkeypatch.setattr(
        fa._ForgettingAttentionFn, "apply", lambda *a: launches.append(a[0].shape[0]) or apply(*a)
    )
    got, got_grads = kernel_and_grads(q, k, v, log_f, do, window_size=6)
    assert launches == [2, 2, 1]
    assert torch.equal(got, want)
    assert all(map(torch.equal, got_grads, want_grads))
    monkeypatch.setattr(fa, "MAX_GRID_Y", 3)
    with pytest.raises(ValueError, match="4 query heads exceed the kernels' grid limit of 3"):
        run_kernel(q, k, v, log_f)


@pytest.mark.parametrize("magnitude", [2.0**16, 2.0**17])
def test_pruning_stays_exact_at_huge_scores(magnitude):
    """With q = k = magnitude * e_0 and scale 1 the scores are ~6e9 to 2.5e10, where float32
    rounds a score by up to 256 to 1024 log2 units. The pruning bound's fixed margin of 10 units
    did not cover that: key tiles a few dozen tokens back (gates ~0.05) that still carried
    weight were skipped (outputs off by 0.2 to 0.4). The bound now adds how far float32 can
    round the scores (``_rounding_slack``): pruning on equals pruning off bit for bit, and the
    tiles behind a gate of e^-1e6 halfway are still skipped."""
    T, D = (320, 16) if DEVICE == "cpu" else (1024, 64)
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = magnitude
    k = q.clone()
    v = torch.randn(1, T, 1, D, generator=gen)
    log_f = F.logsigmoid(torch.randn(1, T, 1, generator=gen) * 2 - 3)
    log_f[:, T // 2] = -1e6
    do = torch.randn(q.shape, generator=gen)
    stats = PruneStats()
    o_on, g_on = kernel_and_grads(q, k, v, log_f, do, scale=1.0, stats=stats)
    o_off, g_off = kernel_and_grads(q, k, v, log_f, do, scale=1.0, prune=False)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dlogf"), (o_on, *g_on), (o_off, *g_off)):
        assert torch.equal(a, b), f"{name} differs with pruning on: {(a - b).abs().max()}"
    assert 0 < stats.tiles_skipped < stats.tiles_total
