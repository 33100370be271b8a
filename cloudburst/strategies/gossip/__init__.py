"""``gossip``: gossiping SGD (Jin et al. 2016), pairwise averaging with no global barrier."""

from typing import Any

from cloudburst.config.fields import ConfigError
from cloudburst.strategies.gossip.settings import GossipConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class Gossip(StrategySpec):
    name = "gossip"
    worker = "cloudburst.strategies.gossip.worker:GossipStrategy"
    settings = (GossipConfig,)
    compression = ("none", "bf16", "fp8", "int8")
    compresses_messages = True
    decentralised = True
    lockstep = True

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.job.workers < 2:
            raise ConfigError("workers: gossip needs at least 2 workers (a peer to average with)")

    @classmethod
    def make_groups(cls, cfg: Any, maker: Any) -> dict[str, Any]:
        # Two gloo groups of the replicas: requests to the serving threads (only they receive
        # on it), and their replies (only the training threads do); see comm/gossip.py.
        return {
            "requests": maker.among("gossip-requests", maker.replicas, "gloo"),
            "replies": maker.among("gossip-replies", maker.replicas, "gloo"),
        }


__getattr__ = worker_attributes(__name__)
