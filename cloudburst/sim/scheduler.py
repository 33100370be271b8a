"""The virtual cluster's core: a deterministic discrete-event scheduler of OS threads.

Every simulated activity (a worker's training loop, a server shard, a gossip serving task)
is a :class:`Task` on its own OS thread with its own virtual clock, but exactly one task runs
at a time: the one whose next event is earliest, ties broken by task id (tasks are numbered
in the order they are spawned, which is itself deterministic). A task runs real Python (real
tensors, real maths) until it asks the scheduler for something that takes virtual time or
waits for another task; it then yields. So a run is a pure function of its inputs.

Why this order is causal: when a task runs at virtual time t, every task whose next event is
earlier has already run up to it, so anything that could happen before t has happened. A task
blocked on something (a message, a collective, a lock) has no event until another task wakes
it with the virtual time at which it can go on (a message's arrival, a collective's end); a
deadline (every blocking operation has one, as every real receive has a timeout) is an event
too. Nothing runnable and nothing due is a deadlock: the run fails with every task's state,
never hangs.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: ``block`` returns this when the deadline passed before anyone woke the task.
TIMEOUT = object()


class SimError(RuntimeError):
    """The simulation cannot go on (a deadlock, or a task failed)."""


class Deadlock(SimError):
    pass


class TaskKilled(BaseException):  # noqa: N818 - not an error: the task's rank was killed
    """Raised inside a task to end it as a SIGKILL ends a process (fault injection)."""


class _Aborted(BaseException):  # noqa: N818
    """Unwinds the tasks left when the run stops (another task failed)."""


class Task:
    """One simulated thread of control. ``rank`` is the rank it belongs to."""

    def __init__(self, sched: Scheduler, tid: int, name: str, rank: int, clock: float, fn):
        self.sched, self.id, self.name, self.rank = sched, tid, name, rank
        self.clock = clock
        self.fn = fn
        self.state = "ready"  # ready | running | blocked | done
        self.waiting_for = ""  # what a blocked task waits for (for deadlock reports)
        self.killed = False
        self.error: BaseException | None = None
        self._version = 0  # invalidates older heap entries
        self._waking = False  # the live entry is a wake (not only a deadline)
        self._entry = math.inf  # the time of this task's live heap entry
        self._value: Any = None  # what a wake hands over
        self._sem = threading.Semaphore(0)
        self._joiners: list[Task] = []
        self.thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)

    def __repr__(self) -> str:
        return f"<Task {self.id} {self.name} t={self.clock:.6f} {self.state}>"

    # ----------------------------------------------------------------- the thread
    def _main(self) -> None:
        self._sem.acquire()
        sched = self.sched
        try:
            if sched._aborting:
                raise _Aborted
            self.fn()
        except TaskKilled:
            self.killed = True
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to Scheduler.run
            self.error = e
            sched._fail(self, e)
        finally:
            self.state = "done"
            if not sched._aborting:
                for joiner in self._joiners:
                    sched.wake(joiner, self.clock)
            sched._leave(self)

    # ----------------------------------------------------------------- joining
    def join(self, timeout: float | None = None) -> None:
        """Wait (in virtual time) until this task has ended."""
        sched = self.sched
        if self.state == "done":
            return
        me = sched.current
        self._joiners.append(me)
        deadline = None if timeout is None else me.clock + timeout
        sched.block(f"join {self.name}", deadline)
        if me in self._joiners:
            self._joiners.remove(me)

    def is_alive(self) -> bool:
        return self.state != "done"


class Scheduler:
    """Runs tasks one at a time in virtual-time order. See the module docstring."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.current: Task | None = None
        self.switches = 0  # task switches (the simulator's overhead)
        self._heap: list[tuple[float, int, int]] = []
        self._done = threading.Event()
        self._aborting = False
        self._error: BaseException | None = None
        self.stalled = ""  # set when a deadline fires with every task waiting (a deadlock)
        self._lock = threading.Lock()
        self._released = False

    # ----------------------------------------------------------------- tasks
    def spawn(self, fn: Callable[[], None], name: str, rank: int, at: float | None = None) -> Task:
        """A new task running ``fn`` from virtual time ``at`` (the spawner's now)."""
        if self._aborting:
            raise _Aborted
        if at is None:
            at = self.current.clock if self.current is not None else 0.0
        task = Task(self, len(self.tasks), name, rank, at, fn)
        self.tasks.append(task)
        task.thread.start()
        self._schedule(task, at)
        return task

    def now(self) -> float:
        return self.current.clock

    def run(self) -> None:
        """Run every task to its end. Raises the first task's error (others are unwound),
        or :class:`Deadlock`."""
        if not self._next():
            return
        self._done.wait()
        for task in self.tasks:
            task.thread.join(timeout=10)
        if self._error is not None:
            raise self._error

    # ----------------------------------------------------------------- the running task
    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass for the running task."""
        if self._aborting:
            raise _Aborted
        me = self.current
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"cannot advance the clock by {seconds!r} s")
        me.clock += seconds
        self._schedule(me, me.clock)
        self._switch(me)

    def block(self, waiting_for: str, deadline: float | None = None) -> Any:
        """Suspend the running task until :meth:`wake` (returns the value it handed over;
        the clock is then the wake time) or until ``deadline`` (returns :data:`TIMEOUT`)."""
        if self._aborting:
            raise _Aborted
        me = self.current
        me.state = "blocked"
        me.waiting_for = waiting_for
        me._value = TIMEOUT
        if deadline is not None:
            self._schedule(me, max(me.clock, deadline), blocked=True)
        else:
            me._version += 1
            me._entry = math.inf
        self._switch(me)
        if me._value is TIMEOUT:
            self.stalled = self._stall_report(me)
        me.waiting_for = ""
        return me._value

    def _stall_report(self, me: Task) -> str:
        """When ``me``'s deadline fires while every other task waits with nothing due but
        deadlines, nothing but timeouts can ever happen: a deadlock, described task by task
        (else "")."""
        others = [t for t in self.tasks if t is not me and t.state != "done"]
        if any(t.state != "blocked" or t._waking for t in others):
            return ""
        return "; ".join(
            f"{t.name} at t={t.clock:.3f}s waits for {t.waiting_for}" for t in [me, *others]
        )

    def wake(self, task: Task, at: float, value: Any = None) -> None:
        """Let a blocked ``task`` go on at virtual time ``at`` (not before its own clock),
        handing it ``value``; an earlier wake or deadline already set wins."""
        if task.state != "blocked" or self._aborting:
            return
        at = max(at, task.clock)
        if at < task._entry:
            task._value = value
            self._schedule(task, at, blocked=True)
            task._waking = True

    # ----------------------------------------------------------------- internals
    def _schedule(self, task: Task, at: float, blocked: bool = False) -> None:
        task._waking = False
        task._version += 1
        task._entry = at
        if not blocked:
            task.state = "ready"
        heapq.heappush(self._heap, (at, task.id, task._version))

    def _pop(self) -> Task | None:
        while self._heap:
            at, tid, version = heapq.heappop(self._heap)
            task = self.tasks[tid]
            if version != task._version or task.state == "done":
                continue
            task.clock = max(task.clock, at)
            task._entry = math.inf
            task.state = "running"
            return task
        return None

    def _next(self) -> bool:
        """Hand the processor to the next task; False when there is none (ended, or a
        deadlock: then the run fails)."""
        task = self._pop()
        if task is None:
            self._finish_or_deadlock()
            return False
        self.current = task
        self.switches += 1
        task._sem.release()
        return True

    def _switch(self, me: Task) -> None:
        task = self._pop()
        if task is me:
            self.current = me
            return
        if task is None:
            self._finish_or_deadlock()
            raise _Aborted
        self.current = task
        self.switches += 1
        task._sem.release()
        me._sem.acquire()
        if self._aborting:
            raise _Aborted

    def _leave(self, me: Task) -> None:
        """``me`` has ended: hand over without waiting."""
        if self._aborting:
            self._abort_all()
        else:
            self._next()

    def _finish_or_deadlock(self) -> None:
        alive = [t for t in self.tasks if t.state != "done"]
        if not alive:
            self._done.set()
            return
        if self._error is None:
            states = "; ".join(
                f"{t.name} at t={t.clock:.3f}s waits for {t.waiting_for or t.state}" for t in alive
            )
            self._error = Deadlock(f"the simulated job is deadlocked: {states}")
        self._aborting = True
        self._abort_all()

    def _fail(self, task: Task, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._aborting = True

    def _abort_all(self) -> None:
        """Release every task once (each unwinds with :class:`_Aborted`); the main thread
        goes on once their threads have ended."""
        with self._lock:
            if self._released:
                return
            self._released = True
        for t in self.tasks:
            if t.state != "done":
                t._sem.release()
        threading.Thread(target=self._await_threads, daemon=True).start()

    def _await_threads(self) -> None:
        for t in self.tasks:
            t.thread.join(timeout=60)
        self._done.set()


class SimLock:
    """A mutex between tasks of the simulation (a contended ``acquire`` blocks in virtual
    time, not the OS thread)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.owner: Task | None = None
        self.waiters: list[Task] = []

    def acquire(self) -> None:
        me = self.sched.current
        while self.owner is not None:
            self.waiters.append(me)
            self.sched.block("a lock")
        self.owner = me

    def release(self) -> None:
        self.owner = None
        if self.waiters:
            self.sched.wake(self.waiters.pop(0), self.sched.now())

    def __enter__(self) -> SimLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
