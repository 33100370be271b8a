"""Fault injection: make a chosen rank die, hang, produce NaNs or run slowly.

Used from the command line (``--inject-fault SPEC``, repeatable) and from tests, to check that
each strategy does what its documentation says when a worker fails:

- ``kill:RANK@STEP``  — the worker of global rank RANK SIGKILLs itself right after step STEP
  (before that step's checkpoint);
- ``stop:RANK@STEP``  — it SIGSTOPs itself after step STEP: a hung peer, found by timeouts;
- ``nan:RANK@STEP``   — its loss at step STEP is NaN (so are its gradients);
- ``slow:RANK:FACTOR`` — every step of it takes FACTOR× its compute time (a straggler;
  FACTOR 1..1000, times any ``--straggler`` factor of the same worker).

Faults target workers (a server rank is refused). A fault fires in the first attempt of a
run only: never again after a restart under ``--max-restarts`` or a ``--resume``, which would
otherwise replay it forever.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from cloudburst.config.fields import MAX_STEPS, SLOWDOWN

log = logging.getLogger(__name__)

KINDS = ("kill", "stop", "nan", "slow")
# At most 18 digits: an int64 (a longer one is not a rank or a step of any run).
_AT = re.compile(r"^(kill|stop|nan):(\d{1,18})@(\d{1,18})$")
_SLOW = re.compile(r"^slow:(\d{1,18}):([0-9.eE+-]{1,32})$")


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0  # kill/stop/nan: after (or at) this step, counted from 1
    factor: float = 1.0  # slow

    @classmethod
    def parse(cls, text: str) -> Fault:
        text = text.strip()
        m = _AT.match(text)
        if m:
            step = int(m.group(3))
            if step < 1:
                raise FaultError(f"{text!r}: STEP counts from 1")
            if step > MAX_STEPS:
                raise FaultError(f"{text!r}: STEP must be <= {MAX_STEPS:_}")
            return cls(m.group(1), int(m.group(2)), step=step)
        m = _SLOW.match(text)
        if m:
            try:
                factor = float(m.group(2))
            except ValueError:
                factor = float("nan")
            if not SLOWDOWN.allows(factor, integer=False):
                raise FaultError(f"{text!r}: FACTOR must be {SLOWDOWN.text(integer=False)}")
            return cls("slow", int(m.group(1)), factor=factor)
        raise FaultError(
            f"{text!r} is not one of kill:RANK@STEP, stop:RANK@STEP, nan:RANK@STEP, "
            "slow:RANK:FACTOR"
        )


def parse_faults(specs: list[str], servers: int, world_size: int) -> list[Fault]:
    faults = [Fault.parse(s) for s in specs]
    for f in faults:
        if f.rank >= world_size:
            raise FaultError(f"rank {f.rank} does not exist (the job has {world_size} ranks)")
        if f.rank < servers:
            raise FaultError(
                f"rank {f.rank} is a parameter server; faults target workers "
                f"(ranks {servers}..{world_size - 1})"
            )
    return faults


class FaultInjector:
    """The faults of one worker; the training loop calls it around every step."""

    def __init__(
        self, faults: list[Fault], rank: int, active: bool = True, on_fire=None, stop=None
    ):
        """``on_fire(fault, step)`` is called when a fault fires, before it takes effect;
        ``stop(kind)`` kills or stops the rank (the transport's: a signal to this process, or
        the simulator's virtual death)."""
        self.on_fire = on_fire or (lambda fault, step: None)
        self.stop = stop or signal_self
        mine = [f for f in faults if f.rank == rank]
        self.slow_factor = 1.0
        for f in mine:
            if f.kind == "slow":
                self.slow_factor *= f.factor
        self._at = {} if not active else {f.step: f for f in mine if f.kind != "slow"}
        self.fired: list[Fault] = []

    def corrupt_loss(self, step: int) -> bool:
        """True when this step's loss must be made NaN."""
        f = self._at.get(step)
        if f is not None and f.kind == "nan":
            self.fired.append(f)
            self.on_fire(f, step)
            log.warning("injected fault %s: this step's loss is NaN", f)
            return True
        return False

    def after_step(self, step: int) -> None:
        """Kill or stop this process when a fault is due after ``step``."""
        f = self._at.get(step)
        if f is None or f.kind not in ("kill", "stop"):
            return
        self.fired.append(f)
        self.on_fire(f, step)
        log.warning("injected fault %s: %s", f, "SIGKILL" if f.kind == "kill" else "SIGSTOP")
        self.stop(f.kind)


def signal_self(kind: str) -> None:
    """Kill (``"kill"``: SIGKILL) or stop (``"stop"``: SIGSTOP) this process, logs flushed."""
    import os
    import signal

    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
