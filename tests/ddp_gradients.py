"""Run under torchrun (2 CPU processes, gloo) by ``test_cuda_graph.py``: the same model's
gradients reduced by DDP's hooks and by ``all_reduce_gradients``, saved per rank.

Usage: ``torchrun --nproc_per_node=2 tests/ddp_gradients.py OUT_DIR``
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fot import presets
from fot.training.parallel import all_reduce_gradients

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = presets.build_model(presets.config("fot_pro", "tiny", vocab_size=300))
plain = copy.deepcopy(model)
ddp = DistributedDataParallel(model)
torch.manual_seed(1 + rank)  # each rank its own tokens, two micro batches
xs = [torch.randint(0, 300, (2, 24)) for _ in range(2)]
with ddp.no_sync():
    ddp(input_ids=xs[0], shift_labels=xs[0]).loss.backward()
ddp(input_ids=xs[1], shift_labels=xs[1]).loss.backward()
for x in xs:
    plain(input_ids=x, shift_labels=x).loss.backward()
local = [p.grad.clone() for p in plain.parameters()]
all_reduce_gradients(list(plain.parameters()), world_size=2)
torch.save(
    {
        "ddp": [p.grad for p in model.parameters()],
        "ours": [p.grad for p in plain.parameters()],
        "local": local,
    },
    f"{sys.argv[1]}/rank{rank}.pt",
)
dist.destroy_process_group()
