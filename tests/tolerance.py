"""Elementwise closeness with a relative and a scale-relative absolute tolerance, shared by the
kernel tests (``from tolerance import assert_close``; ``tests/`` is on ``sys.path``)."""

from __future__ import annotations

import torch


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    tol: tuple[float, float],
    name: str,
    scale: float | None = None,
) -> None:
    """``|got - want| <= rtol |want| + atol * scale`` with ``scale = max |want|`` by default.

    Args:
        got, want: tensors of one shape, any float dtype and device (compared in float64).
        tol: ``(rtol, atol)``.
        name: what is compared, for the failure message.
        scale: the absolute tolerance's unit (default ``max |want|``).
    """
    assert got.shape == want.shape, name
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    rtol, atol = tol
    scale = want.abs().max().item() if scale is None else scale
    bound = rtol * want.abs() + atol * scale
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"{name}: max error above tolerance by {excess:.3g}"
