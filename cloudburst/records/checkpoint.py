"""Checkpoint files: atomic writes with a checksum, safe loads.

A checkpoint is ``torch.save`` of ``{"format": FORMAT, "kind": ..., "payload": ...,
"sha256": ...}`` where the checksum covers the payload's serialised bytes. Loading uses
``torch.load(weights_only=True)``, so a file can never run code; a truncated, corrupt or
foreign file raises :class:`CheckpointError` with one line saying why.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "cloudburst-checkpoint-v1"


class CheckpointError(ValueError):
    pass


def _digest(payload: Any) -> str:
    """SHA-256 of the payload's content — structure, keys, tensors' dtype, shape and bytes —
    independent of where its tensors lived: a GPU worker's checkpoint is loaded onto the CPU
    and checked there (``torch.save``'s own bytes record each tensor's device)."""
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, list | tuple):
        h.update(b"[" if isinstance(value, list) else b"(")
        h.update(b"%d" % len(value))
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:  # numbers, strings, bools, None: what weights_only loads besides tensors
        h.update(f"{type(value).__name__}:{value!r};".encode())


def save_checkpoint(path: str | Path, kind: str, payload: dict[str, Any]) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"format": FORMAT, "kind": kind, "payload": payload, "sha256": _digest(payload)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors, zip errors, refused globals: all mean "not ours"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read safely (truncated, corrupt or not a "
            f"cloudburst checkpoint): {first[:200]}"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a {FORMAT} file")
    if kind is not None and record.get("kind") != kind:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a {record.get('kind')!r}, expected {kind!r}"
        )
    if _digest(record["payload"]) != record.get("sha256"):
        raise CheckpointError(f"checkpoint {str(path)!r} fails its checksum (corrupt)")
    return record["payload"]


def save_model(path: str | Path, model: torch.nn.Module, meta: dict[str, Any]) -> None:
    # CPU copies: a model trained on a GPU loads anywhere.
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_checkpoint(path, "model", {"state_dict": state, "meta": meta})


def load_model_into(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    payload = load_checkpoint(path, "model")
    try:
        model.load_state_dict(payload["state_dict"])
    except (RuntimeError, KeyError) as e:
        first = str(e).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model: {first}"
        ) from None
    return payload.get("meta", {})


def model_buffers_bytes(model: torch.nn.Module) -> bytes:
    """A model's buffers (batch-norm running statistics), serialised."""

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.named_buffers()}, buf)
    return buf.getvalue()


def load_model_buffers(model: torch.nn.Module, raw: bytes) -> None:
    """Load buffers serialised by :func:`model_buffers_bytes` (weights only) into ``model``."""

    buffers = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    own = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            if name in own and own[name].shape == value.shape:
                own[name].copy_(value)
