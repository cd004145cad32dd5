"""Run under torchrun (2 CPU processes, gloo) by ``test_train.py``: fot's Muon on FSDP2's
sharded parameters, fed the same gradients on both ranks, against ``torch.optim.Muon`` on the
whole matrices in each process, for three steps. Row counts 7 and 5 do not split evenly over
two ranks, and a one-row matrix leaves rank 1 without rows. Saves, per rank, both models'
weights and momentum buffers as whole tensors, and the refusal of a Muon given sharded and
plain parameters together. The same for fot's Muon on replicated parameters (DDP's case),
which splits the orthogonalisations over the ranks: the shapes each rank orthogonalised.

Usage: ``torchrun --nproc_per_node=2 tests/muon_shards.py OUT_DIR``
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import fot.training.optim as optim
from fot.training.optim import Muon

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(5, 7, bias=False),
    torch.nn.Linear(7, 5, bias=False),
    torch.nn.Linear(5, 12, bias=False),
)
whole = copy.deepcopy(model)
replicated = copy.deepcopy(model)  # DDP's case: every rank the whole matrices
for layer in model:
    fully_shard(layer)
fully_shard(model)


def groups(m: torch.nn.Module) -> list[dict]:
    """Both of torch's LR rules (and one group without weight decay)."""
    return [
        {"params": [m[0].weight, m[1].weight], "adjust_lr_fn": "match_rms_adamw"},
        {"params": [m[2].weight], "adjust_lr_fn": "original", "weight_decay": 0.0},
    ]


sharded_opt = Muon(groups(model), lr=0.05, weight_decay=0.1)
whole_opt = torch.optim.Muon(groups(whole), lr=0.05, weight_decay=0.1)
replicated_opt = Muon(groups(replicated), lr=0.05, weight_decay=0.1, process_group=dist.group.WORLD)
orthogonalised = []  # the shapes this rank orthogonalised in replicated_opt's steps
counted = optim.newton_schulz
for _ in range(3):
    for p, q, r in zip(model.parameters(), whole.parameters(), replicated.parameters()):
        grad = torch.randn(q.shape)  # the same on both ranks (same seed, same draws)
        q.grad, r.grad = grad, grad.clone()
        p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements)
    sharded_opt.step()
    whole_opt.step()
    optim.newton_schulz = lambda x, *a: orthogonalised.append(tuple(x.shape)) or counted(x, *a)
    replicated_opt.step()
    optim.newton_schulz = counted
assert all(type(p).__name__ == "DTensor" for p in model.parameters())
# one matrix of one row: rank 1 holds no rows and orthogonalises nothing
lone = torch.nn.Linear(5, 1, bias=False)
lone_whole = copy.deepcopy(lone)
fully_shard(lone)
lone_opt, lone_whole_opt = Muon(lone.parameters()), torch.optim.Muon(lone_whole.parameters())
for _ in range(2):
    grad = torch.randn(1, 5)
    lone_whole.weight.grad = grad
    lone.weight.grad = distribute_tensor(grad.clone(), lone.weight.device_mesh, [Shard(0)])
    lone_opt.step()
    lone_whole_opt.step()
# bf16 parameters, replicated: tall results are applied as torch applies them (a strided
# view; a bf16 add_ on the CPU rounds a contiguous copy differently)
low = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in ((12, 5), (5, 7), (7, 5))]
low_whole = [torch.nn.Parameter(t.detach().clone()) for t in low]
low_opt = Muon(low, lr=0.05, process_group=dist.group.WORLD)
low_whole_opt = torch.optim.Muon(low_whole, lr=0.05)
for _ in range(3):
    for a, b in zip(low, low_whole, strict=True):
        a.grad = torch.randn(a.shape).bfloat16()
        b.grad = a.grad.clone()
    low_opt.step()
    low_whole_opt.step()
mixed = Muon([model[0].weight, torch.nn.Parameter(torch.zeros(3, 4))])
mixed.param_groups[0]["params"][1].grad = torch.zeros(3, 4)
try:
    mixed.step()
    refused = ""
except ValueError as e:
    refused = str(e)
local_rows = [p.to_local().shape[0] for p in model.parameters()]
result = {
    "sharded": [p.full_tensor() for p in model.parameters()] + [lone.weight.full_tensor()],
    "whole": [q.detach().clone() for q in whole.parameters()] + [lone_whole.weight.detach()],
    "sharded_momentum": [
        sharded_opt.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()
    ],
    "whole_momentum": [whole_opt.state[q]["momentum_buffer"] for q in whole.parameters()],
    "replicated": [r.detach().clone() for r in replicated.parameters()],
    "replicated_momentum": [
        replicated_opt.state[r]["momentum_buffer"] for r in replicated.parameters()
    ],
    "orthogonalised": orthogonalised,
    "bf16_replicated": [t.detach() for t in low],
    "bf16_whole": [t.detach() for t in low_whole],
    "local_rows": [*local_rows, lone.weight.to_local().shape[0]],
    "mixed_refused": refused,
}
torch.save(result, f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
