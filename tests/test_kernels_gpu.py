"""GPU checks of the Triton forgetting attention: bf16, long sequences, vs float64 reference.

Skipped without CUDA. Bar: relative L2 error <= 5e-3 for o, dq, dk, dv and d log f.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.gpu

TOL_BF16 = 5e-3
WEAK, STRONG = 4.0, -2.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, T, HQ, H, D, gate_mean, dtype=torch.bfloat16):
    dev = "cuda"
    q = torch.randn(B, T, HQ, D, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    log_f = F.logsigmoid(torch.randn(B, T, HQ, device=dev) + gate_mean)
    return q, k, v, log_f


def _check(B, T, HQ, H, D, gate_mean, **kw):
    q, k, v, log_f = _inputs(B, T, HQ, H, D, gate_mean)
    do = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, log_f)]
    o = forgetting_attention(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    lf = log_f.clone().requires_grad_(True)
    o_ref = forgetting_attention_reference(*ref_leaves, lf, chunk_size=512, **kw)
    ref_grads = torch.autograd.grad(o_ref, [*ref_leaves, lf], do.double())
    errs = {"o": rel_err(o, o_ref)}
    for name, a, b in zip(("dq", "dk", "dv", "dlogf"), grads, ref_grads):
        errs[name] = rel_err(a, b)
    print(f"B{B} T{T} HQ{HQ} H{H} D{D} gate{gate_mean} {kw}: {errs}")
    bad = {n: e for n, e in errs.items() if not e <= TOL_BF16}
    assert not bad, f"relative error above {TOL_BF16}: {bad} (all: {errs})"


@pytest.mark.parametrize(
    ("B", "T", "HQ", "H", "D", "gate_mean"),
    [
        (1, 65536, 2, 1, 128, WEAK),
        (1, 16384, 4, 2, 64, STRONG),
        (2, 4097, 4, 4, 128, WEAK),
        (1, 3000, 2, 1, 256, WEAK),
        (1, 2999, 4, 2, 32, STRONG),
    ],
)
def test_bf16_matches_float64_reference(B, T, HQ, H, D, gate_mean):
    _check(B, T, HQ, H, D, gate_mean)


def test_bf16_varlen_and_window():
    cu = torch.tensor([0, 1000, 1001, 5000, 8192], device="cuda", dtype=torch.int32)
    _check(1, 8192, 4, 2, 128, WEAK, cu_seqlens=cu)
    _check(1, 8192, 2, 2, 64, WEAK, window_size=1500)
    _check(1, 8192, 2, 1, 128, WEAK, cu_seqlens=cu, window_size=700)


def test_pruning_exact_on_gpu():
    q, k, v, log_f = _inputs(1, 8192, 4, 2, 128, STRONG)
    do = torch.randn_like(q)
    results = []
    for prune in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, log_f)]
        stats = PruneStats()
        o = forgetting_attention(*leaves, prune=prune, stats=stats)
        results.append((o, *torch.autograd.grad(o, leaves, do), stats))
    on, off = results
    for a, b in zip(on[:5], off[:5]):
        assert torch.equal(a, b)
    assert on[5].tiles_skipped > 0.5 * on[5].tiles_total
    assert off[5].tiles_skipped == 0


@pytest.mark.parametrize(
    ("B", "Tq", "Tk", "HQ", "H", "D", "window"),
    [(2, 1, 5000, 8, 2, 128, None), (1, 1, 17408, 24, 24, 64, None), (3, 4, 9000, 6, 3, 64, 700)],
)
def test_decode_on_gpu(B, Tq, Tk, HQ, H, D, window):
    """The split-K decode kernels in bf16 against the float64 reference, caches read through
    head-major views with spare capacity (FoTCache's layout); the 760M layer at a 16k cache."""
    q = torch.randn(B, Tq, HQ, D, device="cuda", dtype=torch.bfloat16)
    kbuf = torch.randn(B, H, Tk + 100, D, device="cuda", dtype=torch.bfloat16)
    vbuf = torch.randn_like(kbuf)
    kc, vc = kbuf[:, :, :Tk].transpose(1, 2), vbuf[:, :, :Tk].transpose(1, 2)
    c = torch.cumsum(F.logsigmoid(torch.randn(B, Tk, HQ, device="cuda") + 4.0), 1)
    mask = torch.ones(B, Tk, dtype=torch.bool, device="cuda")
    mask[0, :100] = False
    kw = {"key_mask": mask, "window_size": window}
    out = forgetting_attention_decode(q, kc, vc, c[:, -Tq:], c, **kw)
    ref = forgetting_attention_decode_reference(
        q.double(), kc.double(), vc.double(), c[:, -Tq:], c, **kw
    )
    assert rel_err(out, ref) < TOL_BF16


def test_kernels_run_on_their_inputs_gpu_while_another_is_current() -> None:
    """Triton launches on the current device: every public kernel given ``cuda:1`` tensors while
    ``cuda:0`` is current must compute on ``cuda:1`` what it computes on ``cuda:0`` (outputs and
    gradients; the same kernels, so bit-equal), and leave ``cuda:0`` current. Launched on the
    wrong GPU, a kernel does not wait for its inputs on their GPU's stream."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from fot.kernels import add_rms_norm, linear_cross_entropy, norm_gate, shift_norm, swiglu

    torch.manual_seed(0)
    B, T, H, D, N, V = 2, 1500, 4, 64, 256, 1000
    q, k, v, log_f = _inputs(B, T, H, H, D, WEAK)
    x = torch.randn(B, T, N, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(N, device="cuda")
    head = 0.05 * torch.randn(V, N, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (B * T,), device="cuda")
    hw = 1 + 0.1 * torch.randn(H, D, device="cuda")
    gate = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    shift = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)
    ops = {
        "forgetting_attention": lambda q, k, v, f: forgetting_attention(q, k, v, f),
        "add_rms_norm": lambda x, w: add_rms_norm(x, x, w)[0],
        "swiglu": lambda x: swiglu(x),
        "linear_cross_entropy": lambda x, h, y: linear_cross_entropy(x.reshape(-1, N), h, y),
        "shift_norm": lambda q, s, w: shift_norm(q, s, w),
        "norm_gate": lambda q, g, w: norm_gate(q, g, w),
    }
    args = {
        "forgetting_attention": (q, k, v, log_f),
        "add_rms_norm": (x, w),
        "swiglu": (x,),
        "linear_cross_entropy": (x, head, labels),
        "shift_norm": (q, shift, hw),
        "norm_gate": (q, gate, hw),
    }
    for name, op in ops.items():
        on = {}
        for dev in ("cuda:0", "cuda:1"):
            moved = [a.detach().to(dev) for a in args[name]]
            with torch.cuda.device(dev):  # the inputs are written after ~30 ms on dev's stream:
                torch.cuda._sleep(60_000_000)  # a kernel on another stream would read too early
                inp = [a * 1 for a in moved]
            for a in inp:
                a.requires_grad_(a.is_floating_point())
            out = op(*inp)
            out.float().square().sum().backward()
            on[dev] = [out.detach().cpu()] + [a.grad.cpu() for a in inp if a.grad is not None]
        assert torch.cuda.current_device() == 0, name
        assert all(map(torch.equal, on["cuda:1"], on["cuda:0"])), name


def test_batch_times_heads_beyond_the_grid_limit() -> None:
    """B * heads above CUDA's 65535 limit on a grid's second dimension (a large batch of short
    sequences) runs: attention in parts, the Pro components in PyTorch. Oracle: the first rows
    computed alone (attention: the same kernels, so bit-equal)."""
    from fot.kernels import shift_norm

    torch.manual_seed(0)
    q, k, v, log_f = _inputs(16385, 8, 4, 2, 16, WEAK)  # B * HQ = 65540
    for t in (q, k, v, log_f):
        t.requires_grad_(True)
    o = forgetting_attention(q, k, v, log_f)
    o.float().square().sum().backward()
    part = [t.detach()[:100].clone().requires_grad_(True) for t in (q, k, v, log_f)]
    o_part = forgetting_attention(*part)
    o_part.float().square().sum().backward()
    assert torch.equal(o[:100], o_part)
    for t, p in zip((q, k, v, log_f), part):
        assert torch.equal(t.grad[:100], p.grad)
    x = torch.randn(32769, 4, 2, 16, device="cuda", dtype=torch.bfloat16)  # B * H = 65538
    s = torch.randn(32769, 4, 2, device="cuda")
    w = torch.ones(2, 16, device="cuda")
    assert rel_err(shift_norm(x, s, w)[:50], shift_norm(x[:50], s[:50], w)) <= TOL_BF16
