"""The nodes' NICs shared by the ranks of one machine (:class:`NicState`, issue 30): one small
shared file holds each node's egress and ingress free times and the collectives booked
recently, so that the emulated link queues a rank's transfers behind its node's other ranks'
as the virtual cluster does. Not shared between machines, nor with a rank that rejoined a
running job (docs/simulator.md).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import tempfile
import threading
import time
from contextlib import contextmanager, suppress

#: The most collectives the shared record remembers (the oldest booking goes first): far more
#: than can be in flight at once, so a late member always finds its op.
# The lock's own clock and sleep, bound once (the unit tests replace this module's ``time``).
_lock_clock, _lock_sleep = time.monotonic, time.sleep


NIC_OPS = 512
_NIC_MAGIC = b"CBNIC001"
_HEADER = struct.Struct("<8sII")  # magic, nodes, op slots
_NODE = struct.Struct("<dd")  # egress free, ingress free (perf_counter seconds)
_OP = struct.Struct("<16sddI")  # op key (zeros: empty), last arrival, end (NaN: open), members in


def nic_dir() -> str:
    """Where a shared NIC record lives: ``/dev/shm`` (memory) when present, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shared_clock_ok() -> bool:
    """Whether ``time.perf_counter`` reads one clock for every process of the machine
    (CLOCK_MONOTONIC on Linux), so that free times written by one rank mean the same to
    another."""
    return "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation


class NicState:
    """The NICs of a job's nodes, in a small file shared by the ranks of one machine: per node
    its egress and ingress free times, and a table of the recent collective bookings (an op's
    key, when it was booked, when it ends). Every read and write is under an exclusive
    ``flock`` of the file (and a thread lock), taken within ``lock_timeout_s``.

    Made, it has created the file at ``path`` (zeros: every link free, no booking) or attached
    to the one another rank created. ``unlink`` removes its name; the ranks that have it open
    keep using it (the memory goes when the last one closes)."""

    def __init__(self, path: str, num_nodes: int, lock_timeout_s: float = 30.0):
        if num_nodes < 1:
            raise ValueError(f"num_nodes: {num_nodes} must be >= 1")
        self.path, self.num_nodes, self.lock_timeout_s = path, num_nodes, lock_timeout_s
        self._threads = threading.Lock()  # flock excludes other processes, not our threads
        self._nodes_at = _HEADER.size
        self._ops_at = self._nodes_at + num_nodes * _NODE.size
        size = self._ops_at + NIC_OPS * _OP.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._fd = fd
            with self._flock():
                current = os.fstat(fd).st_size
                if current == 0:
                    os.ftruncate(fd, size)
                elif current != size:
                    raise OSError(
                        f"{path} holds {current} bytes, not a record of {num_nodes} nodes"
                    )
                self._map = mmap.mmap(fd, size)
                magic, nodes, ops = _HEADER.unpack_from(self._map, 0)
                if magic == bytes(8):
                    _HEADER.pack_into(self._map, 0, _NIC_MAGIC, num_nodes, NIC_OPS)
                elif (magic, nodes, ops) != (_NIC_MAGIC, num_nodes, NIC_OPS):
                    raise OSError(f"{path} is not a NIC record of {num_nodes} nodes")
        except BaseException:
            os.close(fd)
            raise

    @contextmanager
    def _flock(self):
        if not self._threads.acquire(timeout=self.lock_timeout_s):
            raise TimeoutError(f"the shared NIC record {self.path} stayed locked (a thread)")
        try:
            with self._file_lock():
                yield
        finally:
            self._threads.release()

    @contextmanager
    def _file_lock(self):
        deadline = _lock_clock() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if _lock_clock() > deadline:
                    raise TimeoutError(
                        f"the shared NIC record {self.path} stayed locked for "
                        f"{self.lock_timeout_s:g} s"
                    ) from None
                _lock_sleep(0.0002)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def locked(self):
        """The record, held for one booking (a context manager)."""
        return self._flock()

    # ------------------------------------------------------------------ under locked()
    def free(self, node: int) -> tuple[float, float]:
        """(egress free, ingress free) of ``node``."""
        return _NODE.unpack_from(self._map, self._nodes_at + node * _NODE.size)

    def set_free(self, node: int, egress_s: float, ingress_s: float) -> None:
        _NODE.pack_into(self._map, self._nodes_at + node * _NODE.size, egress_s, ingress_s)

    def _find(self, key: bytes) -> int | None:
        for i in range(NIC_OPS):
            if _OP.unpack_from(self._map, self._ops_at + i * _OP.size)[0] == key:
                return i
        return None

    def op(self, key: bytes) -> tuple[float, float, int] | None:
        """Op ``key`` (16 bytes): (its last member's arrival so far, its end — NaN while
        members are still to come —, how many members have arrived); None if unbooked."""
        i = self._find(key)
        return None if i is None else _OP.unpack_from(self._map, self._ops_at + i * _OP.size)[1:]

    def op_end(self, key: bytes) -> float | None:
        """When op ``key`` ends; None if it is unbooked or members are still to come."""
        op = self.op(key)
        return None if op is None or math.isnan(op[1]) else op[1]

    def set_op(self, key: bytes, arrival_s: float, end_s: float, members: int) -> None:
        """Write op ``key``: in its slot, else an empty one, else in place of the closed op
        whose last member arrived first (an open op is never dropped)."""
        slot, oldest, oldest_at = self._find(key), None, math.inf
        if slot is None:
            for i in range(NIC_OPS):
                k, at, end, _ = _OP.unpack_from(self._map, self._ops_at + i * _OP.size)
                if k == bytes(16):
                    oldest = i
                    break
                if not math.isnan(end) and at < oldest_at:
                    oldest, oldest_at = i, at
            if oldest is None:
                raise RuntimeError(f"the shared NIC record {self.path} has {NIC_OPS} open ops")
            slot = oldest
        _OP.pack_into(self._map, self._ops_at + slot * _OP.size, key, arrival_s, end_s, members)

    # ------------------------------------------------------------------ lifetime
    def unlink(self) -> None:
        """Remove the record's name (idempotent; every rank of the job may call it)."""
        with suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._fd is not None:
            self._map.close()
            os.close(self._fd)
            self._fd = None


class PendingEnd:
    """The end of a shared collective whose other members are still to book it: known once
    the last one has (:func:`resolve_end`)."""

    #: the most a member waits for the others' bookings once the real collective is done
    #: (they book right after launching it, so a miss means one of them is gone)
    TIMEOUT_S = 60.0

    def __init__(self, nic: NicState, key: bytes, name: str):
        self.nic, self.key, self.name = nic, key, name

    def peek(self) -> float | None:
        with self.nic.locked():
            return self.nic.op_end(self.key)

    def wait(self, timeout_s: float | None = None) -> float:
        limit = self.TIMEOUT_S if timeout_s is None else timeout_s
        deadline = _lock_clock() + limit
        while (end := self.peek()) is None:
            if _lock_clock() > deadline:
                raise TimeoutError(
                    f"emulated link: collective {self.name} still had members to come "
                    f"{limit:g} s after it ran"
                )
            _lock_sleep(0.0002)
        return end


def resolve_end(end: float | PendingEnd) -> float:
    """A booking's end: itself, or a :class:`PendingEnd` waited for."""
    return end.wait() if isinstance(end, PendingEnd) else end
