"""Test settings shared by the whole suite.

* Offline: no hub, no dataset hub, no wandb server.
* No GPU: Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), which must be set
  before triton is imported. Triton's autotuner would still benchmark every config through the
  GPU driver ("0 active drivers"), so under the interpreter its benchmark is replaced by a
  no-op timing and the first config runs.
* ``@pytest.mark.gpu`` tests are skipped (and reported as skipped) without CUDA. With CUDA they
  share one pytest-xdist worker (``--dist loadgroup``), so that up to 4 workers never run the
  large ones on one GPU at once.
* Every test starts with torch's global RNG seeded with 0, so a test that draws from it (most
  kernel and model tests do) sees the same numbers run alone, in any order, on any worker.
* torchrun's per-run log folders go under pytest's temp folder (``PET_LOG_DIR``), not the
  system temp folder.
* The ``device`` fixture is where a test that runs Triton kernels (ours or FLA's) puts its
  models and tensors: CUDA on a GPU machine (there the kernels are compiled and cannot read CPU
  tensors), CPU under the interpreter otherwise. Such a test runs on both kinds of machines.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# The command-line mains that tests call in-process turn datasets' progress bars off; where
# datasets is not imported yet they do it through its environment variable, which would hold
# for every later test of the worker (datasets reads it once, and it outranks
# enable_progress_bars). Imported here, datasets is switched through its own functions. (On a
# machine without datasets, a GPU box carrying only what its tests need, the tests that use it
# fail on their own import.)
with contextlib.suppress(ImportError):
    import datasets  # noqa: F401
import pytest  # noqa: E402

if not HAS_CUDA:
    from fot.models.fla_baselines import untimed_autotune_in_interpreter

    untimed_autotune_in_interpreter()


@pytest.fixture(autouse=True)
def _torch_rng_seeded_per_test():
    """torch's global RNG (CPU and CUDA) seeded with 0 before each test: without it a test's
    random inputs depend on which tests its pytest-xdist worker ran before it, and a failure
    seen in CI may not come back when the test is run alone."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _torchrun_logs_in_pytest_temp(tmp_path_factory):
    """torchrun (the multi-process tests launch it) puts each run's log folders under pytest's
    temp folder, which pytest prunes, through its ``PET_LOG_DIR`` variable; without one it makes
    a ``torchelastic_*`` folder in the system temp folder per run that nothing removes. A
    ``PET_LOG_DIR`` already set is kept."""
    if "PET_LOG_DIR" not in os.environ:
        os.environ["PET_LOG_DIR"] = str(tmp_path_factory.mktemp("torchrun-logs"))


@pytest.fixture
def device():
    """``cuda`` where there is a GPU, else ``cpu`` (the Triton interpreter, above).

    On CUDA, float32 matmuls and convolutions run without TF32 for the test (PyTorch turns TF32
    on for cuDNN by default), so tolerances written for float32 on CPU hold; the previous
    settings come back afterwards.
    """
    if not HAS_CUDA:
        yield torch.device("cpu")
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:  # under pytest-xdist (`--dist loadgroup`) one worker runs them, one at a time
        if not config.pluginmanager.hasplugin("xdist"):  # its marker is unknown without it
            return
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
