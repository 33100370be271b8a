"""Run directories: where a run may write, which files it owns, and writes that never follow
a symlink.

A run writes only into a directory that is new, empty, or marked as a cloudburst run by the
marker file :data:`MARKER` (written first, before anything else). A directory holding anything
else is refused in one line unless the user passes ``--overwrite``. A new run in a marked
directory removes only the files a run writes (:func:`clear_run_files`) — never a directory
tree, never a file it does not know by name.

The subdirectories a run writes into (``metrics``, ``checkpoints``, ``logs``, ``tensorboard``)
must not be symlinks, and files are opened with ``O_NOFOLLOW`` (or written to a temporary file
and renamed over the target), so that a planted link cannot make a run write elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

from cloudburst.config import ConfigError

MARKER = ".cloudburst-run"
# Directories a run creates and writes into.
SUBDIRS = ("metrics", "checkpoints", "logs", "tensorboard")
# Files a run writes, by name, relative to its directory (globs). Only these are ever removed.
RUN_FILES = (
    "summary.json",
    "model.pt",
    "metrics/rank*.jsonl",
    "checkpoints/worker*-step*.pt",
    "checkpoints/server*.pt",
)
# Temporary files of an atomic write (``.NAME.XXXXXX``) that a killed process left behind.
_TEMP = re.compile(
    r"^\.(summary\.json|config\.json|model\.pt|worker\d+-step\d+\.pt|server\d+\.pt)\."
)


def default_out(strategy: str) -> str:
    """A fresh directory name, ``runs/<strategy>-<time>-<random>``: two runs started in the
    same second never share one. Under torchrun every rank must agree on it, so the job's
    rendezvous id names it there (one directory per job)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id in ("", "none"):
            raise ConfigError(
                "out: under torchrun without --rdzv-id the ranks cannot agree on a generated "
                "directory name; pass --out DIR (the same on every node)"
            )
        return f"runs/{strategy}-{re.sub(r'[^A-Za-z0-9_.-]', '_', run_id)[:40]}"
    return f"runs/{strategy}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_run_dir(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Raise :class:`ConfigError` (one line) unless a run may write into ``out``."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out: {str(path)!r} is a file, not a directory; choose another --out")
    for sub in SUBDIRS:
        if (path / sub).is_symlink():
            raise ConfigError(
                f"out: {str(path / sub)!r} is a symbolic link; a run does not write through "
                "links (remove it or choose another --out)"
            )
    if not path.is_dir() or (path / MARKER).is_file():
        return
    if resume and (path / "config.json").is_file():
        return  # a run written before the marker existed
    entries = sorted(p.name for p in path.iterdir())
    if entries and not overwrite:
        shown = ", ".join(repr(e) for e in entries[:3]) + (" ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"out: {str(path)!r} is not empty and is not a cloudburst run directory (it holds "
            f"{shown}); choose a new directory, or pass --overwrite to write into it (a run "
            "only ever replaces or removes its own files)"
        )


def prepare_run_dir(out: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Check ``out``, mark it as a run directory, and (for a new run) remove an earlier run's
    files. Returns the directory."""
    check_run_dir(out, resume=resume, overwrite=overwrite)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    if not resume or run_nonce(path) is None:
        # A new run gets a new identity; checkpoints carry it, so a file from another run in
        # this directory (or copied in) is never resumed.
        nonce = secrets.token_hex(8)
        write_text_nofollow(path / MARKER, json.dumps({"cloudburst_run": nonce}) + "\n")
    for sub in SUBDIRS[:2]:
        (path / sub).mkdir(exist_ok=True)
    clear_temp_files(path)
    if not resume:
        clear_run_files(path)
    return path


def run_nonce(out: str | Path) -> str | None:
    """The random identity of the run in ``out`` (from its marker), or None."""
    try:
        text = (Path(out) / MARKER).read_text()[:256]
        value = json.loads(text).get("cloudburst_run")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def clear_run_files(path: Path) -> list[Path]:
    """Remove the files an earlier run wrote into ``path`` (by name only); returns them."""
    removed = []
    for pattern in RUN_FILES:
        for f in path.glob(pattern):
            if f.is_file() or f.is_symlink():
                f.unlink()
                removed.append(f)
    return removed


def clear_temp_files(path: Path) -> None:
    """Remove temporary files of atomic writes that a killed process left behind."""
    for d in (path, path / "checkpoints"):
        if d.is_dir() and not d.is_symlink():
            for f in d.iterdir():
                if _TEMP.match(f.name) and (f.is_file() or f.is_symlink()):
                    f.unlink()


def open_append_nofollow(path: str | Path, buffering: int = 1):
    """Open ``path`` for appending text; refuses (``OSError``) when ``path`` is a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", buffering=buffering)


def write_text_nofollow(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (created or truncated); refuses to follow a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def safe_label(spec: str) -> str:
    """A run's directory name from a label: ``asgd:n_sync=10`` → ``asgd-n_sync=10`` (odd
    characters become ``-``)."""
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", spec.replace(":", "-").replace(",", "-"))
