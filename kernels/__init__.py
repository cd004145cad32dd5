"""Forgetting-attention kernels (imported as ``fot.kernels``).

* :func:`forgetting_attention` — Triton forward + backward (CUDA, or CPU under
  ``TRITON_INTERPRET=1``), varlen/GQA/window, exact block pruning.
* :func:`forgetting_attention_reference` — pure PyTorch oracle, any device.
* :func:`forgetting_attention_decode` / :func:`forgetting_attention_decode_reference` — a few
  new queries against a K/V cache and a cached gate cumsum (split-K Triton kernels on CUDA or
  under the interpreter, batched PyTorch matmuls elsewhere); the first can apply the output
  norm and gate in its merge kernel (``gate=``, ``norm_weight=``).
* :func:`shift_norm` / :func:`norm_gate` — fused FoT (Pro) components (KV-shift + per-head
  RMSNorm; output norm + gate): Triton on CUDA (or under the interpreter), PyTorch elsewhere.
* :func:`add_rms_norm` — residual add + RMSNorm of the pre-norm blocks, one kernel each way
  (same dispatch as the Pro components).
* :func:`linear_cross_entropy` — the LM head and the cross-entropy fused chunk by chunk, the
  gradients computed in the forward (Triton row kernel on CUDA, PyTorch elsewhere).
* :func:`swiglu` — the MLP's ``silu(gate) * up`` from one ``[..., 2 * I]`` projection, one
  kernel each way (same dispatch as the Pro components).
* :func:`mixed_precision_linear` — bias-free projections with float32 master weights under
  autocast: one cast launch for all weights, float32 weight gradients from the GEMM.
* :func:`few_rows_linear` — a decode step's projections: a few rows times several weights in
  one launch, without concatenating the weights (inference only).
* :func:`few_rows_logsigmoid_linear` — a decode step's forget gate: a float32 projection of a
  few rows and its log-sigmoid in one launch (inference only).
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: Python was started in the checkout root (a REPL, a
    # notebook, `python -m ...`), which puts the root on sys.path, and something imported
    # `kernels` before `fot` took the root off it. That name belongs to Hugging Face's `kernels`
    # package, which transformers (>= 5.25) imports: hand the name over to it. Where it is not
    # installed, stand in as an empty namespace: transformers 5.10-5.24 import `kernels` to ask
    # whether it is installed (`import transformers.modeling_utils`, `import fla`) and read a
    # module without `__file__` or `__version__` as "not installed".
    import importlib.util as _util
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder

    # real paths: the root reached through a symlink (PYTHONPATH, a .pth) and through the
    # resolved current folder ('') is one folder, else each would find the other's kernels/
    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        import types as _types
        from importlib.machinery import ModuleSpec as _ModuleSpec

        _why = (
            f"Hugging Face's `kernels` package is not installed, and the fot checkout {_root}'s "
            "kernels/ folder is fot.kernels (import fot.kernels), not a top-level module"
        )

        def _no_attribute(name: str) -> None:
            raise AttributeError(f"module 'kernels' has no attribute {name!r}: {_why}")

        _module = _types.ModuleType("kernels", f"An empty stand-in: {_why}.")
        _module.__spec__ = _ModuleSpec("kernels", None, is_package=True)  # no origin, no file
        _module.__path__ = []
        _module.__getattr__ = _no_attribute
        _sys.modules["kernels"] = _module
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # the import statement returns what is here at the end
        _spec.loader.exec_module(_module)
else:
    from .decode import forgetting_attention_decode
    from .forgetting_attention import PruneStats, forgetting_attention
    from .linear_ops import few_rows_linear, few_rows_logsigmoid_linear, mixed_precision_linear
    from .loss_ops import linear_cross_entropy
    from .mlp_ops import swiglu
    from .norm_ops import add_rms_norm
    from .pro_ops import norm_gate, shift_norm
    from .reference import forgetting_attention_decode_reference, forgetting_attention_reference

    __all__ = [
        "PruneStats",
        "add_rms_norm",
        "few_rows_linear",
        "few_rows_logsigmoid_linear",
        "forgetting_attention",
        "forgetting_attention_decode",
        "forgetting_attention_decode_reference",
        "forgetting_attention_reference",
        "linear_cross_entropy",
        "mixed_precision_linear",
        "norm_gate",
        "shift_norm",
        "swiglu",
    ]
