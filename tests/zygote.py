"""A process that has imported the CLI once and forks one child per :func:`tests.support.cli`
call, each running ``cloudburst ARGS`` as ``python -m cloudburst ARGS`` would, without a fresh
interpreter importing torch again (about 4.5 CPU-s a job).

A child shares with a fresh ``python -m cloudburst`` the command line, the working directory,
the environment (``PYTHONPATH``'s entries first on ``sys.path``), stdin from /dev/null, stdout
and stderr to pipes, a session of its own, and a state no earlier job touched (each is a fork
of the zygote, which runs none). Variables read while the interpreter or torch start cannot be
shared (:func:`startup_env`): ``tests.support.cli`` sends such calls to a fresh process.

Protocol, one job at a time, JSON lines: the client writes {"args", "cwd", "env", "stdout",
"stderr"} (FIFOs the client reads) and optionally "sigint_default"; the zygote answers {"pid"}
once it forked, then {"code"} once the child exited."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import traceback

# Read when the interpreter or torch start: a child cannot change them.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "LD_", "CUDA", "MALLOC")


def startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k != "PYTHONPATH"}


def _child(request: dict, base_path: list[str], outputs: list[int]) -> None:
    code = 1
    try:
        os.setsid()
        if request.get("sigint_default"):  # as an interpreter started with SIGINT's default
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [*extra, *base_path]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, target in ((1, outputs[0]), (2, outputs[1])):
            os.dup2(target, fd)
            os.close(target)
        entry = importlib.util.find_spec("cloudburst.__main__").origin  # python -m's argv[0]
    except BaseException:  # noqa: BLE001 - the child's setup failed: say so on its stderr
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(code)
    try:
        from cloudburst.cli import main

        sys.argv = [entry, *request["args"]]
        code = main(request["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """The zygote's loop (``python -m tests.zygote``, from the repository)."""
    # As cloudburst/__main__.py does for ``python -m``: the working directory is not importable.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    base_path = list(sys.path)
    # The CLI and what its forkserver preloads: a child's forkserver, forked from it, then
    # imports nothing.
    import cloudburst.cli  # noqa: F401
    from cloudburst.forkserver import forkserver_preload

    for module in forkserver_preload():
        importlib.import_module(module)

    channel = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else may write to the channel
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        # The FIFOs the client reads: opened before the fork, so that the child holds their
        # write ends by the time the client hears its pid.
        outputs = [os.open(request[k], os.O_WRONLY) for k in ("stdout", "stderr")]
        pid = os.fork()
        if pid == 0:
            channel.close()
            _child(request, base_path, outputs)
        for fd in outputs:
            os.close(fd)
        channel.write(json.dumps({"pid": pid}) + "\n")
        channel.flush()
        _, status = os.waitpid(pid, 0)
        channel.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        channel.flush()


if __name__ == "__main__":
    serve()
