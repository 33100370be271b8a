"""``local_sgd``: local SGD / post-local SGD, the replicas averaged every H local steps."""

from cloudburst.strategies.local_sgd.settings import LocalSgdConfig
from cloudburst.strategies.spec import StrategySpec, worker_attributes


class LocalSgd(StrategySpec):
    name = "local_sgd"
    worker = "cloudburst.strategies.local_sgd.worker:LocalSgdStrategy"
    settings = (LocalSgdConfig,)
    compression = ("none", "bf16", "fp8", "int8")
    lockstep = True


__getattr__ = worker_attributes(__name__)
