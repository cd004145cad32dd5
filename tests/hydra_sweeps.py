"""A real Hydra multirun folder for tests of what reads one (labels, wandb names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_empty_sweep(folder: Path, *overrides: str) -> Path:
    """Run a Hydra multirun of an app that does nothing, with ``overrides`` (``-m`` implied),
    in ``folder``; returns the sweep folder (``folder/s``), which holds ``multirun.yaml`` and
    the jobs ``0``, ``1``, ... with their ``.hydra/overrides.yaml``."""
    app = folder / "app.py"
    app.write_text(
        "import hydra\n"
        "@hydra.main(version_base='1.3', config_path=None, config_name=None)\n"
        "def main(cfg):\n    pass\n"
        "main()\n"
    )
    args = ["-m", *overrides, "hydra.sweep.dir=s"]
    subprocess.run([sys.executable, str(app), *args], cwd=folder, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return folder / "s"
