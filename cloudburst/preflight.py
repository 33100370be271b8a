"""Checks before anything is launched that need more than the config itself: the dataset is
read, the model is built for it and run on two samples, devices and backends exist, an
``--init-from`` checkpoint fits, a ``--resume`` directory's checkpoints load. Each failure is a
:class:`~cloudburst.config.ConfigError`: one line, exit code 2, nothing started.
"""

from __future__ import annotations

import os
import sys

from cloudburst.config import ConfigError, RunConfig, field_message


def preflight(cfg: RunConfig) -> None:
    """Checks that need more than the config itself, done before anything is launched.

    The dataset is read (a missing or malformed one fails here, in one line), the model is
    built for it (a bad factory or a model that does not fit the data fails here) and an
    ``init_from`` checkpoint is loaded into it.
    """
    from cloudburst.checkpoint import CheckpointError, load_model_into
    from cloudburst.data import load_dataset
    from cloudburst.datasets import DatasetError
    from cloudburst.models import ModelError, build_model
    from cloudburst.runtime import in_torchrun

    if cfg.device == "cuda" and not _cuda_available():
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device here")
    if cfg.backend == "nccl" and not in_torchrun() and _cuda_available():
        import torch

        if torch.cuda.device_count() < cfg.workers:
            raise ConfigError(
                f"backend: nccl needs one GPU per worker; this machine has "
                f"{torch.cuda.device_count()} for {cfg.workers} workers (NCCL cannot run two "
                "ranks on one GPU); use --backend gloo or auto"
            )
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "tensorboard: the tensorboard package is not installed "
                "(pip install 'cloudburst[tensorboard]')"
            ) from None
    try:
        data = load_dataset(
            cfg.dataset, cfg.train_size, cfg.test_size, cfg.image_size, context=cfg.context
        )
    except DatasetError as e:
        raise ConfigError(field_message("dataset", e)) from None
    if cfg.train_size is None:
        shard = len(data.train) // cfg.workers
        if cfg.batch_size > shard:
            raise ConfigError(
                f"batch_size: {cfg.batch_size} is larger than each worker's shard of {shard} "
                f"samples ({len(data.train)} training samples / {cfg.workers} workers)"
            )
    try:
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    except ModelError as e:
        raise ConfigError(field_message("model", e)) from None
    _check_forward(cfg, model, data)
    if cfg.init_from:
        try:
            load_model_into(cfg.init_from, model)
        except CheckpointError as e:
            raise ConfigError(f"init_from: {e}") from None
    if cfg.resume:
        from cloudburst.resilience import check_resumable

        try:
            what = check_resumable(cfg)
        except CheckpointError as e:
            raise ConfigError(f"resume: {e}") from None
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"cloudburst: {what}", file=sys.stderr)


def _check_forward(cfg: RunConfig, model, data) -> None:
    """One forward pass on two test samples: the model must take this data's input."""
    import torch

    from cloudburst.data import in_memory

    x, _ = in_memory(data.test).get_batch(torch.arange(min(2, len(data.test))))
    pre = data.preprocess(augment=False)
    if pre is not None:
        x = pre(x)
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # noqa: BLE001 - any failure means "does not fit"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"model: {cfg.model!r} fails on this dataset's input of shape "
            f"{tuple(x.shape[1:])}: {first[:200]}"
        ) from None
    # A language model (text datasets) predicts every position: [B, T, vocabulary].
    lm = getattr(data, "is_lm", False)
    expected = (*x.shape, data.num_classes) if lm else (x.shape[0], data.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model: {cfg.model!r} returns {shape} for a batch of {x.shape[0]}; this dataset "
            f"needs logits of shape {expected}"
        )


def _cuda_available() -> bool:
    import os

    # NVML's answer does not initialise CUDA in this process, which forks the job's ranks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()
