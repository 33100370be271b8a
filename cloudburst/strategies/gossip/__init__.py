"""``gossip``: gossiping SGD (Jin et al. 2016), pairwise averaging with no global barrier."""

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
    process_groups = ("gossip_pair",)


__getattr__ = worker_attributes(__name__)
