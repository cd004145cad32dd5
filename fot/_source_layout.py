"""Make ``fot.kernels`` and ``fot.eval`` importable from a source checkout.

An installed ``fot`` (``pip install .`` or ``pip install -e .``) maps the top-level folders
``kernels/`` and ``eval/`` to ``fot.kernels`` and ``fot.eval`` through ``package-dir`` in
pyproject.toml. When Python instead imports ``fot`` straight from a checkout (``python
train.py`` in the repo root puts the root first on ``sys.path``), those two folders sit beside
``fot/`` rather than inside it. This finder maps exactly these two names to the folders and
nothing else. It also takes the checkout root off ``sys.path`` (it is only there because a
script or ``python -m`` ran from it), so that ``kernels/`` and ``eval/`` are never importable as
top-level modules: transformers probes for a package named ``kernels``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_SUBPACKAGES = {"fot.kernels": "kernels", "fot.eval": "eval"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = _SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)]
        )


def install(package_dir: Path) -> None:
    """Register the finder when ``fot`` was imported from a checkout (no ``fot/kernels``)."""
    if (package_dir / "kernels").exists():
        return  # installed layout: fot/kernels and fot/eval are real subfolders
    root = package_dir.parent
    if not (root / "kernels" / "__init__.py").is_file():
        return
    sys.path[:] = [p for p in sys.path if not _is_root(p, root)]
    if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder(root))


def _is_root(entry: str, root: Path) -> bool:
    try:
        return Path(os.path.abspath(entry or os.curdir)) == root
    except (OSError, ValueError):
        return False
