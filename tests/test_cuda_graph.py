"""``parallel.cuda_graphs``: the training step replayed as one CUDA graph trains exactly as the
eager step does (GPU), and runs it cannot serve are refused up front with the fix (CPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from fot import presets
from fot.data.tokens import write_token_documents
from fot.training import register_configs, train
from fot.training.checkpoint import list_checkpoints
from fot.training.config import ParallelConfig
from fot.training.cuda_graph import GraphedStep, check_cuda_graphs

ROOT = Path(__file__).resolve().parents[1]
register_configs()


def _documents(path: Path, n_docs: int = 400, seed: int = 0) -> Path:
    """A token folder of documents of 5-80 tokens: padded sequences of 64 tokens then hold
    different numbers of label tokens."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50000, int(rng.integers(5, 81))) for _ in range(n_docs)]
    write_token_documents(path, docs)
    return path


def _overrides(out_dir: Path, data: Path, *overrides: str) -> list[str]:
    return [
        "++model.overrides={hidden_size:64,num_hidden_layers:2,num_heads:2}",
        "data=tokens",
        f"data.path={data}",
        f"data.val_path={data}",
        "data.seq_len=64",
        "data.packing=padded",
        "data.val_tokens=256",
        "global_batch_tokens=256",
        "micro_batch_size=2",  # two micro batches per step
        "total_tokens=2560",
        "log_every_tokens=256",  # every step
        "val_every_tokens=1280",
        "ckpt_every_tokens=1280",  # one checkpoint between replays
        "schedule.warmup_tokens=1024",  # a new learning rate every step
        "optim.lr=0.01",
        "export_hf=false",
        "progress=false",
        "wandb.mode=disabled",
        f"out_dir={out_dir}",
        *overrides,
    ]


def _cfg(out_dir: Path, data: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=_overrides(out_dir, data, *overrides))


def _pythonpath() -> str:
    """PYTHONPATH for a subprocess: the checkout first, then what this process was given."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_checkpoints(eager: Path, graphed: Path) -> None:
    """The two runs saved checkpoints at the same steps, two of them (step 5, between replays,
    and the final step 10), with bit-identical weights."""
    ckpts = list_checkpoints(eager / "checkpoints")
    assert [p.name for p in ckpts] == [p.name for p in list_checkpoints(graphed / "checkpoints")]
    assert len(ckpts) == 2
    for p in ckpts:
        wa = torch.load(p / "model.pt")
        wb = torch.load(graphed / "checkpoints" / p.name / "model.pt")
        assert wa.keys() == wb.keys()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (p.name, name)


TIMING = {"tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_mem_gib", "elapsed_s"}


def _values(records: list[dict]) -> list[dict]:
    """The records without their timings and memory."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_config_checks_name_the_fix() -> None:
    on = ParallelConfig(cuda_graphs=True)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"needs a CUDA device.*cuda_graphs=false"):
        check_cuda_graphs(on, strategy="single", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"parallel=fsdp.*use parallel=ddp or single"):
        check_cuda_graphs(on, strategy="fsdp", device=cuda)
    with pytest.raises(ValueError, match=r"parallel\.compile=false"):
        check_cuda_graphs(
            ParallelConfig(cuda_graphs=True, compile=True), strategy="single", device=cuda
        )
    check_cuda_graphs(on, strategy="single", device=cuda)  # what it is for
    check_cuda_graphs(on, strategy="ddp", device=cuda)
    check_cuda_graphs(ParallelConfig(), strategy="ddp", device=torch.device("cpu"))  # off


def test_cpu_run_is_refused_before_anything_is_written(tmp_path) -> None:
    data = _documents(tmp_path / "docs")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        train(_cfg(out, data, "device=cpu", "parallel.cuda_graphs=true"))
    assert not out.exists()


def test_graphed_step_needs_a_capturable_optimizer() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(lambda *a: None, opt, device=torch.device("cpu"))


def test_all_reduce_gradients_equals_ddp(tmp_path) -> None:
    """parallel=ddp with CUDA graphs averages gradients itself: on two CPU processes (gloo)
    its gradients equal DDP's, bit for bit, and differ from each rank's own, in both of two
    steps; DDP's gradients are views of its buckets (no second copy), after the step and
    while micro batches accumulate without syncing, from the second step on (the first
    backward allocates them; the trainer then zeroes them in place)."""
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "ddp_gradients.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for steps in results:
        assert len(steps) == 2
        for res in steps:
            assert len(res["ddp"]) == len(res["ours"]) > 10
            assert all(torch.equal(a, b) for a, b in zip(res["ddp"], res["ours"], strict=True))
            ours, local = res["ours"], res["local"]
            assert not all(torch.equal(a, b) for a, b in zip(ours, local, strict=True))
            assert all(res["bucket_views"])
        assert all(steps[1]["bucket_views_while_accumulating"])
        assert not torch.equal(steps[0]["ours"][0], steps[1]["ours"][0])
    for step in (0, 1):
        pairs = zip(results[0][step]["ours"], results[1][step]["ours"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def _clipped(grads: list[torch.Tensor], max_norm: float, clip) -> tuple[torch.Tensor, list]:
    """``clip``'s total norm of parameters with ``grads``, and the gradients after it."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    total = clip(params, max_norm)
    return total, [p.grad.clone() for p in params]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_gradient_norm_does_not_depend_on_where_the_gradients_lie(device: str) -> None:
    """Eager DDP's gradients are views into its buckets, at addresses that a parameter of a few
    floats leaves off 16 bytes; the graphed step's are their own allocations. torch's
    clip_grad_norm_ sums a gradient's squares in an order that follows its address, so on an
    H200 the two took different steps from equal gradients (the norms 1 ulp apart at step 2 of
    test_graphed_ddp_training_equals_eager_ddp). fot's clip_grad_norm gives, wherever the
    gradients lie, the norm and clipped gradients of torch's on their own allocations."""
    from fot.training.optim import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    for size in (2048, 4099, 10_000, 65_541, 3 * 65_536 + 5):
        for max_norm in (1.0, float("inf")):
            # a 3-float parameter with a zero gradient first: the total is the second's norm,
            # which lies right after it in the bucket (off 16 bytes at most shifts)
            own = [torch.zeros(3), torch.randn(size, generator=gen) * 0.1]
            own = [g.to(device) for g in own]
            want, want_grads = _clipped([g.clone() for g in own], max_norm,
                                        torch.nn.utils.clip_grad_norm_)  # fmt: skip
            for shift in range(8):  # where the first gradient starts, in floats
                bucket = torch.zeros(shift + 3 + size, device=device)
                views = [bucket[shift : shift + 3], bucket[shift + 3 :]]
                for v, g in zip(views, own, strict=True):
                    v.copy_(g)
                total, grads = _clipped(views, max_norm, clip_grad_norm)
                where = f"size {size}, max_norm {max_norm}, shift {shift}"
                assert torch.equal(total, want), (where, total.item(), want.item())
                assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
                if max_norm == 1.0:  # clipped: the norm is about 0.1 * sqrt(size) > 1
                    assert not torch.equal(grads[1], own[1]), where


def test_all_reduce_gradients_names_a_parameter_without_gradient() -> None:
    from fot.training.parallel import all_reduce_gradients

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3, 4))]
    params[0].grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"parameter 1 \(3, 4\) got no gradient"):
        all_reduce_gradients(params, world_size=2)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padded_cu_seqlens_change_nothing(backend: str) -> None:
    """The graph's fixed cu_seqlens buffer (the step's boundaries, then copies of the last)
    gives the same logits and gradients as the step's own boundaries, bit for bit. (One
    layer: every layer reads the same boundaries.)"""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = presets.config(
        "fot_pro", "tiny", vocab_size=300, attn_backend=backend, num_hidden_layers=1
    )
    model = presets.build_model(cfg).to(dev)
    T = 48
    x = torch.randint(0, 300, (1, T), device=dev)
    cu = torch.tensor([0, 5, 6, 20, 33, T], dtype=torch.int32)
    padded = torch.cat([cu, torch.full((T + 1 - cu.numel(),), T, dtype=torch.int32)])
    results = []
    for c in (cu, padded):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=x, cu_seqlens=c.to(dev)).logits
        model(input_ids=x, shift_labels=x, cu_seqlens=c.to(dev)).loss.backward()
        results.append((logits, [p.grad.clone() for p in model.parameters()]))
    (la, ga), (lb, gb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
    # and the boundaries matter: without them the logits differ
    assert not torch.allclose(model(input_ids=x).logits, la)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "act_ckpt,packing", [(False, "padded"), (True, "padded"), (False, "varlen")]
)
def test_graphed_training_equals_eager(tmp_path, caplog, act_ckpt: bool, packing: str) -> None:
    """Ten steps of two micro batches with a new learning rate and new label counts (and, with
    varlen packing, new document boundaries) every step: the eager run is the oracle for the
    graphed one (losses, gradient norms, validation and the weights in both checkpoints)."""
    data = _documents(tmp_path / "docs")
    extra = [
        "device=cuda",
        f"parallel.activation_checkpointing={str(act_ckpt).lower()}",
        f"data.packing={packing}",
    ]
    eager = train(_cfg(tmp_path / "eager", data, *extra))
    with caplog.at_level(logging.INFO, logger="fot.train"):
        graphed = train(_cfg(tmp_path / "graphed", data, *extra, "parallel.cuda_graphs=true"))
    assert sum("captured as a CUDA graph" in r.message for r in caplog.records) == 1

    a, b = _records(tmp_path / "eager"), _records(tmp_path / "graphed")
    steps = [r for r in a if "loss" in r]
    assert len(steps) == 10
    assert len({r["loss"] for r in steps}) == 10  # the run is not trivially constant
    assert sum("val/loss" in r for r in a) == 2  # after step 5 (between replays) and at the end
    assert _values(a) == _values(b)  # losses, gradient norms, learning rates, validation
    assert eager["val/loss"] == graphed["val/loss"]
    _assert_same_checkpoints(tmp_path / "eager", tmp_path / "graphed")


@pytest.mark.gpu
def test_graphed_ddp_training_equals_eager_ddp(tmp_path) -> None:
    """Two GPUs, parallel=ddp, two micro batches per rank and step: the graphed run (no DDP
    wrapper; the step all-reduces the gradients inside the graph) logs the same losses,
    gradient norms and validation as the eager DDP run, and saves the same weights."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    data = _documents(tmp_path / "docs")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": _pythonpath()}
    for name, extra in (("eager", []), ("graphed", ["parallel.cuda_graphs=true"])):
        out = tmp_path / name
        args = _overrides(out, data, "device=cuda", "parallel=ddp", "micro_batch_size=1", *extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(ROOT / "train.py"), *args, f"hydra.run.dir={out}"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "captured as a CUDA graph" in (tmp_path / "graphed" / "train.log").read_text()

    a, b = _records(tmp_path / "eager"), _records(tmp_path / "graphed")
    steps = [r for r in a if "loss" in r]
    assert len(steps) == 10 and len({r["loss"] for r in steps}) == 10
    assert sum("val/loss" in r for r in a) == 2
    assert _values(a) == _values(b)
    info = json.loads((tmp_path / "graphed" / "run_info.json").read_text())[0]
    assert info["world_size"] == 2 and info["strategy"] == "ddp" and info["accum_steps"] == 2
    _assert_same_checkpoints(tmp_path / "eager", tmp_path / "graphed")
