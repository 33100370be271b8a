"""The job secret: what a peer of cloudburst's own protocol proves it knows before it is let in.

torch.distributed's store and gloo's listeners authenticate nobody: any process that reaches
them can write keys and open connections. So wherever cloudburst admits a peer — a rejoin
announcement on the :class:`~cloudburst.comm.liveness.RejoinBoard`, the gloo groups a job forms (at
start-up, for a rejoining worker, for a restarted shard, a shard's standby) — the peer must show
an HMAC-SHA256 under a secret that travels outside the store:

- a local job (``cloudburst train``): the launcher makes 32 random bytes
  (:func:`new_secret`) and hands them to each rank with its entry point
  (:class:`WithJobSecret`), pickled through the forkserver's private pipe, never the store,
  the environment or a file;
- under the user's own torchrun (one or many machines): ``CLOUDBURST_JOB_SECRET_FILE`` names a
  regular file only its owner can read (a group- or world-readable one is refused), or
  ``CLOUDBURST_JOB_SECRET`` holds the secret itself; at least 16 bytes either way.

Without one (torchrun only), start-up groups are formed unauthenticated (with a warning) and a
restarted rank is refused: rejoining is the moment a stranger could take a place in a running
job, so it is never done on trust.

A group is authenticated by :func:`authenticate_group`: every member contributes a fresh
random nonce (one all-gather), then an HMAC over all the nonces, the group's context and its
own group rank (a second one); each member checks every other's. A member that does not know
the secret cannot produce its tag, and nothing else moves on the group before this.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

import torch

from cloudburst.config.fields import ConfigError

ENV_SECRET = "CLOUDBURST_JOB_SECRET"
ENV_SECRET_FILE = "CLOUDBURST_JOB_SECRET_FILE"
SECRET_BYTES = 32  # what the launcher makes
MIN_SECRET_BYTES = 16  # what a user's secret must have at least (128 bits)
MAX_SECRET_FILE_BYTES = 4096  # a secret file is read up to this (a key, not a data file)
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
_LABEL = b"cloudburst-auth-v1"

_installed: bytes | None = None  # given to this process by its launcher (WithJobSecret)
_loaded: tuple[bytes | None] | None = None  # the environment's, read once


class SecretError(ConfigError):
    """No usable job secret (one line that names the fix; the CLI prints it, exit code 2)."""


class PeerRefused(RuntimeError):
    """A peer did not prove it knows the job secret."""


def new_secret() -> bytes:
    """A fresh job secret (the local launcher's, one per job)."""
    return secrets.token_bytes(SECRET_BYTES)


def install(secret: bytes | None) -> None:
    """Make ``secret`` this process's job secret (None: back to the environment's)."""
    global _installed, _loaded
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"a job secret needs {MIN_SECRET_BYTES} bytes at least")
    _installed, _loaded = secret, None


class WithJobSecret:
    """A local job's rank entry point that installs the job secret, then runs ``entrypoint``.

    It is pickled to each rank (and to each restart of it) with its arguments, through the
    forkserver's pipe: the secret reaches the ranks outside the job store and the environment
    (the forkserver's environment is fixed before the job's secret exists)."""

    def __init__(self, entrypoint: Callable[..., Any], secret: bytes):
        self.entrypoint, self._secret = entrypoint, secret
        # torch elastic names the job after its entry point
        self.__name__ = getattr(entrypoint, "__name__", "cloudburst")
        self.__qualname__ = getattr(entrypoint, "__qualname__", self.__name__)
        self.__module__ = getattr(entrypoint, "__module__", __name__)

    def __call__(self, *args: Any) -> Any:
        install(self._secret)
        return self.entrypoint(*args)

    def __repr__(self) -> str:  # never the secret (an agent logs its entry point)
        return f"WithJobSecret({self.__qualname__})"


def with_job_secret(entrypoint: Callable[..., Any]) -> WithJobSecret:
    """``entrypoint`` with a new job secret for its ranks (the local launcher's)."""
    return WithJobSecret(entrypoint, new_secret())


def job_secret() -> bytes | None:
    """This process's job secret: installed by its launcher, else from
    ``CLOUDBURST_JOB_SECRET_FILE`` or ``CLOUDBURST_JOB_SECRET``; None when none is given.
    Raises :class:`SecretError` (one line) for a secret that cannot be used."""
    global _loaded
    if _installed is not None:
        return _installed
    if _loaded is None:
        _loaded = (_secret_from_environment(),)
    return _loaded[0]


def require_secret(what: str) -> bytes:
    """The job secret, or :class:`SecretError` saying that ``what`` needs one."""
    secret = job_secret()
    if secret is None:
        raise SecretError(
            f"{what} needs the job secret, and none was given: set "
            f"{ENV_SECRET_FILE} to a file only you can read (the same on every machine), or "
            f"{ENV_SECRET}; see docs/security.md"
        )
    return secret


def _secret_from_environment() -> bytes | None:
    path, value = os.environ.get(ENV_SECRET_FILE), os.environ.get(ENV_SECRET)
    if path and value:
        raise SecretError(f"both {ENV_SECRET_FILE} and {ENV_SECRET} are set; set one")
    if path:
        return read_secret_file(path)
    if value:
        secret = value.strip().encode()
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(
                f"{ENV_SECRET} holds {len(secret)} bytes, a job secret needs "
                f"{MIN_SECRET_BYTES} at least (e.g. `openssl rand -hex 32`)"
            )
        return secret
    return None


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path``: a regular file of this user's that no one else may read, of
    ``MIN_SECRET_BYTES`` .. ``MAX_SECRET_FILE_BYTES`` bytes (surrounding whitespace dropped)."""
    name = f"{ENV_SECRET_FILE}={str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK)
    except OSError as e:
        raise SecretError(f"{name}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)  # of the file opened (a link is followed: Kubernetes mounts use them)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{name} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(f"{name} belongs to uid {st.st_uid}, not to you")
        if st.st_mode & 0o077:
            raise SecretError(
                f"{name} is open to others (mode {stat.S_IMODE(st.st_mode):04o}); `chmod 600` it"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            secret = f.read(MAX_SECRET_FILE_BYTES + 1).strip()
    finally:
        os.close(fd)
    if len(secret) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"{name} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"{name} holds {len(secret)} bytes, a job secret needs "
            f"{MIN_SECRET_BYTES} at least (e.g. `openssl rand -hex 32 > FILE`)"
        )
    return secret


def run_identity() -> str:
    """What tells this job from another run under the same secret: torch elastic's run id
    (the local launcher's is random per job; under torchrun, ``--rdzv-id``)."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "none")


# ---------------------------------------------------------------------------- MACs
def mac(secret: bytes, *fields: object) -> bytes:
    """HMAC-SHA256 under ``secret`` of ``fields``, each length-prefixed (no two different
    field lists encode alike)."""
    h = hmac.new(secret, _LABEL, hashlib.sha256)
    for field in fields:
        data = field if isinstance(field, bytes) else str(field).encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.digest()


def sign(secret: bytes, *fields: object) -> str:
    """:func:`mac` in hex (for JSON records)."""
    return mac(secret, *fields).hex()


def verify(secret: bytes, signature: object, *fields: object) -> bool:
    """Whether ``signature`` (hex) is :func:`sign` of ``fields``; in constant time."""
    if not isinstance(signature, str) or len(signature) != 2 * MAC_BYTES:
        return False
    return hmac.compare_digest(signature, sign(secret, *fields))


# ---------------------------------------------------------------------------- groups
def authenticate_group(group: Any, context: str, secret: bytes) -> None:
    """Check that every member of the gloo process group ``group`` knows ``secret``; raises
    :class:`PeerRefused` naming those that do not. Every member calls it, before anything
    else is sent on the group. ``context`` names the group (and its run) the same way on every
    member: a tag made for one group is worth nothing on another.

    Two all-gathers: fresh nonces, then each member's HMAC over (context, its group rank, the
    nonces). Fresh nonces from every honest member make a recorded tag useless later; its rank
    in the tag makes one member's tag useless in another's place. A member that does not take
    part within the group's timeout, or sends something else, is refused the same way: the
    caller cannot tell it from an impostor, and must not treat it as a peer."""
    try:
        _authenticate(group, context, secret)
    except PeerRefused:
        raise
    except RuntimeError as e:  # gloo: timed out, a connection closed, a message of another size
        text = str(e).strip()
        first = (text.splitlines()[0] if text else type(e).__name__)[:200]
        raise PeerRefused(
            f"{context}: a member did not complete the job-secret check ({first}); refused"
        ) from e


def _authenticate(group: Any, context: str, secret: bytes) -> None:
    me, size = group.rank(), group.size()
    nonce = torch.frombuffer(bytearray(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8)
    nonces = _all_gather(group, nonce, size)
    joined = b"".join(bytes(n.numpy()) for n in nonces)

    def tag_of(rank: int) -> bytes:
        return mac(secret, "group", run_identity(), context, size, rank, joined)

    own = torch.frombuffer(bytearray(tag_of(me)), dtype=torch.uint8)
    tags = _all_gather(group, own, size)
    refused = [
        r
        for r in range(size)
        if r != me and not hmac.compare_digest(bytes(tags[r].numpy()), tag_of(r))
    ]
    if refused:
        raise PeerRefused(
            f"{context}: group rank(s) {refused} did not prove the job secret (a process that "
            "is not of this job, or one given another secret); refused"
        )


def _all_gather(group: Any, tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(size)]
    group.allgather([out], [tensor]).wait()
    return out
