"""Gossip's receiving folds on a CUDA replica: the peers' messages arrive in host memory (the
mailbox) while the replica θ is on the GPU; :func:`push_fold` and :func:`push_sum_fold` move
the received sums to θ's device and fold them in place, with the values the CPU gives.

Skipped without CUDA (CI has none); on CPU the formulas are pinned in test_gossip_graph.py.
"""

from __future__ import annotations

import pytest
import torch

from cloudburst.strategies.gossip.worker import push_fold, push_sum_fold

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_push_fold_of_host_messages_into_a_cuda_replica():
    own, received = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([7.0, 10.0, 12.0])  # 3 messages
    out = push_fold(own.cuda(), received, 3)
    assert out.device.type == "cuda"
    assert out.cpu().tolist() == [2.0, 3.0, 4.0]  # (θ + Σ) / (1 + n)
    boundary = torch.tensor([1.0, 2.0, 0.0])  # θ^b: the local step since is kept in full
    out = push_fold(own.cuda(), received, 3, boundary.cuda())
    assert out.cpu().tolist() == [2.0, 3.0, 7.0]  # (θ^b + Σ) / (1 + n) + (θ − θ^b)


def test_push_sum_fold_of_host_messages_into_a_cuda_replica():
    own = torch.tensor([2.0, 4.0])
    numerators, weight_sum = torch.tensor([3.0, 0.0]), 0.5  # Σ θ_j·w_j, Σ w_j
    out, weight = push_sum_fold(own.cuda(), 0.5, numerators, weight_sum)
    assert out.device.type == "cuda" and weight == 1.0
    assert out.cpu().tolist() == [4.0, 2.0]  # (θ·w + Σ numerators) / (w + Σ w)
