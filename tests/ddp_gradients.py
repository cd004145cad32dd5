"""Run under torchrun (2 CPU processes, gloo) by ``test_cuda_graph.py``: the same model's
gradients reduced by DDP's hooks (fot's DDP, ``wrap_ddp``) and by ``all_reduce_gradients``,
saved per rank, for two steps of two micro batches, zeroed between them as the trainer zeroes
them (in place for DDP); and whether DDP's gradients are views of its buckets, after the
micro batch that accumulates without syncing and after the step.

Usage: ``torchrun --nproc_per_node=2 tests/ddp_gradients.py OUT_DIR``
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from fot import presets
from fot.training.parallel import all_reduce_gradients, wrap_ddp

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = presets.build_model(presets.config("fot_pro", "tiny", vocab_size=300))
plain = copy.deepcopy(model)
ddp = wrap_ddp(model, torch.device("cpu"))
torch.manual_seed(1 + rank)  # each rank its own tokens, two micro batches per step
steps = []
for _ in range(2):
    ddp.zero_grad(set_to_none=False)
    plain.zero_grad(set_to_none=True)
    xs = [torch.randint(0, 300, (2, 24)) for _ in range(2)]
    with ddp.no_sync():
        ddp(input_ids=xs[0], shift_labels=xs[0]).loss.backward()
    views_while_accumulating = [p.grad._base is not None for p in model.parameters()]
    ddp(input_ids=xs[1], shift_labels=xs[1]).loss.backward()
    for x in xs:
        plain(input_ids=x, shift_labels=x).loss.backward()
    local = [p.grad.clone() for p in plain.parameters()]
    all_reduce_gradients(list(plain.parameters()), world_size=2)
    steps.append(
        {
            "ddp": [p.grad.clone() for p in model.parameters()],
            "ours": [p.grad.clone() for p in plain.parameters()],
            "local": local,
            "bucket_views": [p.grad._base is not None for p in model.parameters()],
            "bucket_views_while_accumulating": views_while_accumulating,
        }
    )
    with torch.no_grad():  # the next step starts from other weights, as after an update
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            a.sub_(0.1 * a.grad)
            b.sub_(0.1 * b.grad)
torch.save(steps, f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
