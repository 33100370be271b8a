"""Stopping a job: a SIGSTOPped (hung) process cannot act on SIGTERM, so ``_stop`` SIGKILLs it
at once instead of waiting out the grace period; and a process of a job dies with its parent."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

from cloudburst import launch
from cloudburst.launch import agents as launch_agents
from cloudburst.launch import processes
from tests.support import wait_until

pytestmark = pytest.mark.spawns


def _sleep_forever(ready, ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("stopped", [True, False])
def test_a_process_that_cannot_act_on_sigterm_is_killed_without_waiting_for_the_grace(stopped):
    """SIGSTOPped (hung), or ignoring SIGTERM after a second signal asked to kill now: with an
    unbounded grace, _stop returns only because it SIGKILLed the process."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_sleep_forever, args=(ready, not stopped))
    proc.start()
    try:
        assert ready.wait(60)
        request = launch._StopRequest()
        if stopped:
            os.kill(proc.pid, signal.SIGSTOP)
            while processes.process_state(proc.pid) not in ("T", "t"):
                time.sleep(0.01)
        else:
            request.kill_now = True  # what a second Ctrl-C / SIGTERM during the stop sets
        launch._stop([proc], request, grace_s=float("inf"), announce=False)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()


def test_state_reads_proc():
    assert processes.process_state(os.getpid()) in ("R", "S")
    proc = mp.get_context("fork").Process(target=time.sleep, args=(600,))
    proc.start()
    proc.kill()
    proc.join()
    assert processes.process_state(proc.pid) is None


@pytest.mark.parametrize("with_timeout", [True, False])
def test_the_agent_shutdown_patch_fits_either_torch_signature(monkeypatch, with_timeout):
    """torch 2.13's ``LocalElasticAgent._shutdown(death_sig, timeout)`` and older torch's
    ``_shutdown(death_sig)`` (a GPU machine's own torch): the shortened grace calls either
    (an older torch got a third argument and crashed the agent after a rank failed)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.multiprocessing.spawn import ProcessContext

    calls = []
    if with_timeout:

        def original(self, death_sig=signal.SIGTERM, timeout=30):
            calls.append((death_sig, timeout))
    else:

        def original(self, death_sig=signal.SIGTERM):
            calls.append((death_sig,))

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", original)
    monkeypatch.setattr(ProcessContext, "join", ProcessContext.join)
    launch_agents._shorten_agent_stop_grace()
    LocalElasticAgent._shutdown(object(), signal.SIGKILL)
    grace = (launch_agents.AGENT_STOP_GRACE_S,) if with_timeout else ()
    assert calls == [(signal.SIGKILL, *grace)]


def _middle(ready) -> None:
    """A parent (as an agent or the forkserver is) whose child asked to die with it."""
    child = os.fork()
    if child == 0:
        from cloudburst.forkserver import die_with_parent

        die_with_parent(os.getppid())
        ready.send(os.getpid())
        time.sleep(600)
        os._exit(0)
    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("stopped", [False, True])
def test_a_process_dies_with_its_sigkilled_parent_even_when_stopped(stopped):
    """What keeps a SIGKILLed launcher from leaving agents and ranks behind: each process of
    a job asks the kernel to SIGKILL it when its parent exits — a SIGSTOPped one too."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    parent = ctx.Process(target=_middle, args=(send,))
    parent.start()
    child = None
    try:
        assert receive.poll(60)
        child = receive.recv()
        if stopped:
            os.kill(child, signal.SIGSTOP)
        parent.kill()
        parent.join()
        # Reaped by whoever adopted it, or a zombie there: no longer running either way.
        wait_until(lambda: processes.process_state(child) in (None, "Z"), timeout_s=60,
                   what="the orphan to die")  # fmt: skip
    finally:
        if parent.is_alive():
            parent.kill()
        if child is not None and processes.process_state(child) not in (None, "Z"):
            os.kill(child, signal.SIGKILL)  # not left behind when the test fails
