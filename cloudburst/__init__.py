"""cloudburst: relaxed-synchronisation data-parallel training on torch.distributed."""

from cloudburst.config import ConfigError, RunConfig

__version__ = "0.1.0"


def __getattr__(name: str):
    # Job pulls in torch.distributed; import it only when asked for.
    if name in ("Job", "shard_dataset"):
        from cloudburst import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["ConfigError", "Job", "RunConfig", "__version__", "shard_dataset"]
