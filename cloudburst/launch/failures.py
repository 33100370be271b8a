"""Why a local job failed, in one line: the first rank's exception (its error file, else the
last exception line of its log), the loss the run gave up on, or the agents' exit codes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from cloudburst.records.metrics import iter_jsonl

log = logging.getLogger(__name__)


def failure_reason(out: Path) -> str | None:
    """The first loss a rank's watchdog recorded (``peer_lost``), e.g. "server shard 1
    (rank 1) lost at 12.3 s", or None."""
    return _first_loss(out)[0]


def _first_loss(out: Path) -> tuple[str | None, int | None]:
    """(reason, lost rank) of the first ``peer_lost`` record, or (None, None)."""
    first = None
    for path in (out / "metrics").glob("rank*.jsonl"):
        for record in iter_jsonl(path):
            if record.get("event") == "peer_lost" and isinstance(record.get("reason"), str):
                if first is None or record.get("time_s", 0) < first.get("time_s", 0):
                    first = record
    if first is None:
        return None, None
    lost = first.get("lost_rank")
    return first["reason"], lost if type(lost) is int else None


def job_failure(out: Path, codes: list[int | None]) -> str:
    """Why a job that wrote no summary failed, in one line: the loss a watchdog recorded
    (with the lost rank's own error, when it left one), else the first error a rank raised
    (``rank 2 failed: OSError: [Errno 28] No space left on device``), else the agents' exit
    codes. Files that cannot be read are skipped."""
    reason, lost_rank = None, None
    with unreadable_skipped():
        reason, lost_rank = _first_loss(out)
    errors: dict[int, str] = {}
    with unreadable_skipped():
        errors = first_rank_errors(out)
    if reason is not None:
        own = errors.get(lost_rank) if lost_rank is not None else None
        return f"{reason}: {own}" if own else reason
    if errors:
        rank, line = next(iter(errors.items()))
        return f"rank {rank} failed: {line}"
    return f"ranks failed (agent exit codes {codes})"


# A Python exception's last traceback line: "OSError: [Errno 28] No space left on device".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b.*$")
_LOG_TAIL_BYTES = 16384  # how much of a rank's stderr.log is searched for its exception


def first_rank_errors(out: Path) -> dict[int, str]:
    """The first line of the exception each failed rank raised, by global rank, earliest
    first: torch's ``error.json`` under ``logs/agent{a}/<run>/attempt_{n}/{local_rank}/``, or
    where there is none (a full disk, a rank torch did not wrap) the last exception line in
    the tail of the rank's ``stderr.log``. Global rank = agent + local rank (a local job has
    one agent per rank, or one agent with every rank)."""
    found: list[tuple[float, int, str]] = []
    for rank_dir in sorted((out / "logs").glob("agent*/*/attempt_*/*")):
        agent, local = rank_dir.parts[-4].removeprefix("agent"), rank_dir.name
        if not (agent.isdigit() and local.isdigit()):
            continue
        rank = int(agent) + int(local)
        when, line = _error_file_line(rank_dir / "error.json")
        if line is None:
            when, line = float("inf"), log_exception_line(rank_dir / "stderr.log")
        if line is not None:
            found.append((when, rank, line))
    errors: dict[int, str] = {}
    for _, rank, line in sorted(found):
        errors.setdefault(rank, line)
    return errors


def _error_file_line(path: Path) -> tuple[float, str | None]:
    """(timestamp, first line of the message) of torch's error file, or (inf, None)."""
    try:
        with open(path, "rb") as f:
            message = json.loads(f.read(_LOG_TAIL_BYTES * 4))["message"]
        info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        message = message["message"] if isinstance(message, dict) else message
    except FileNotFoundError:
        return float("inf"), None
    except (ValueError, KeyError, TypeError, AttributeError):  # not torch's format
        return float("inf"), None
    try:
        when = float(info.get("timestamp", "inf"))
    except (ValueError, TypeError, AttributeError):
        when = float("inf")
    lines = str(message).strip().splitlines()
    return when, (lines[0][:500] if lines else None)


def log_exception_line(path: Path) -> str | None:
    """The exception line ending the last traceback in the tail of a rank's log, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except FileNotFoundError:
        return None
    _, traceback, last = tail.rpartition("Traceback (most recent call last):")
    matches = [x for x in last.splitlines() if _EXCEPTION_LINE.match(x)] if traceback else []
    return matches[-1][:500] if matches else None


def rank_errors(out: Path) -> list[str]:
    """The exception each failed rank reported (torch's ``error.json`` under ``logs/``), one
    line each, the first of every distinct message only."""
    found: list[str] = []
    for path in sorted((out / "logs").glob("**/error.json")):
        try:
            _, line = _error_file_line(path)  # the one reader of torch's error files
        except OSError:
            continue
        if line and line not in found:
            found.append(line)
    return found


class Unreadable:
    """Counts the launcher's looks at the run's files that failed (``OSError``: EMFILE when a
    flood of connections to the store took every descriptor); says so once on the console."""

    failures = 0


@contextlib.contextmanager
def unreadable_skipped() -> Iterator[None]:
    """Skip one look at the run's files that raised ``OSError``: the job goes on, and is
    still stopped when it ends (the kill path needs no descriptor)."""
    try:
        yield
    except OSError as e:
        Unreadable.failures += 1
        if Unreadable.failures == 1:
            print(
                f"cloudburst: warning: the launcher cannot read the run's files ({e}); "
                "it keeps supervising the job",
                file=sys.stderr,
                flush=True,
            )
        log.debug("cannot read the run's files (%d times): %s", Unreadable.failures, e)
