"""``sync``: synchronous all-reduce with ``DistributedDataParallel`` itself (the baseline)."""

from cloudburst.strategies.spec import StrategySpec, worker_attributes


class Sync(StrategySpec):
    name = "sync"
    worker = "cloudburst.strategies.sync.worker:SyncStrategy"
    compression = ("none", "bf16", "fp8", "int8", "powersgd")
    lockstep = True
    node_replicas_refused = "every step is already synchronous across every worker"


__getattr__ = worker_attributes(__name__)
