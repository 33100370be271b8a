"""Imported by the forkserver that local jobs' ranks are forked from: builds what every rank
builds first, once, so that the ranks inherit it instead of each importing it again.

The first ``torch.optim`` optimizer imports torch's compiler stack (~800 modules, ~2 s of CPU
per process): on a 2-core machine, four ranks doing it at once were most of a small job's
start-up. The strategies' worker classes (imported by the registry only when a rank builds
one) and their shards' server modules are imported here too.
"""

import torch

from cloudburst.strategies import REGISTRY
from cloudburst.strategies.spec import load

torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for spec in REGISTRY.values():
    spec.worker_class()
    if spec.server:
        load(spec.server)
