"""cloudburst: relaxed-synchronisation data-parallel training on torch.distributed."""

from cloudburst.config import ConfigError, RunConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "RunConfig", "__version__"]
