"""Run under torchrun (3 CPU processes, gloo) by ``test_train.py``: DDP's gradients of one
step computed as a process's first step and as its second, each process settled first by
:func:`fot.training.parallel.settle_ddp_buckets`. Saves, per rank, whether they are equal bit
for bit, whether the settling left zero gradients, and whether it left torch's RNG state as
it was (the model draws from it: dropout).

Usage: ``torchrun --nproc_per_node=3 tests/ddp_buckets.py OUT_DIR``
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from fot.training.parallel import settle_ddp_buckets, wrap_ddp

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Embedding(3000, 48), torch.nn.Dropout(0.1), torch.nn.Linear(48, 48),
    torch.nn.Linear(48, 3000),
)  # fmt: skip
data = [torch.randint(0, 3000, (4, 16), generator=torch.Generator().manual_seed(10 * rank + s))
        for s in (1, 2)]  # fmt: skip


def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logsumexp(-1).mean()


def step_grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One backward (dropout's mask drawn from a fixed seed); the all-reduced gradients."""
    model.zero_grad(set_to_none=False)
    torch.manual_seed(1)
    loss(model, x).backward()
    return [p.grad.clone() for p in model.parameters()]


result = {"rng_kept": True, "grads_zero": True}
starts = []
for _ in range(2):  # an uninterrupted run, then a run resumed at its second step
    model = wrap_ddp(copy.deepcopy(net), torch.device("cpu"))
    rng = torch.get_rng_state()
    settle_ddp_buckets(model, lambda m=model: loss(m, data[0]))
    result["rng_kept"] &= torch.equal(rng, torch.get_rng_state())
    result["grads_zero"] &= all(p.grad is None or not p.grad.any() for p in model.parameters())
    starts.append(model)
uninterrupted = [step_grads(starts[0], x) for x in data][1]
resumed = step_grads(starts[1], data[1])
result["equal"] = all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))
torch.save(result, f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
