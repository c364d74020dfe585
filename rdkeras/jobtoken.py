"""The job token: the secret every rank of a job proves it knows at rendezvous.

Where it comes from, first match wins:

1. ``RDKERAS_JOB_TOKEN``: the token itself (``python -m rdkeras.launch`` sets a
   fresh random one per job; a Kubernetes Secret can be exposed this way).
2. ``RDKERAS_JOB_TOKEN_FILE``: a file holding it (a Kubernetes Secret mounted
   as a volume).
3. The user's secret file, ``$XDG_CONFIG_HOME/rdkeras/job-token`` (by default
   ``~/.config/rdkeras/job-token``), created on first use: 32 random bytes, mode
   0600 in a 0700 folder, written to a temporary name and linked into place, so
   two ranks creating it at once (also over NFS) end with one file. Cluster
   nodes share the home directory, so every rank of a SLURM, TF_CONFIG or
   torchrun job finds the same secret with no manual step. A file that another
   user could read or write, or that this user does not own, is refused.

From the user's secret, each job gets its own token, an HMAC of the job's
identity (:func:`rdkeras.cluster.job_key`: the SLURM job and step, the
TF_CONFIG cluster, the torchrun run or rendezvous address): two jobs of the
same user cannot join each other, and nobody without the file can compute it.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from rdkeras import options
from rdkeras.errors import EngineError

ENV_TOKEN = "RDKERAS_JOB_TOKEN"
ENV_TOKEN_FILE = "RDKERAS_JOB_TOKEN_FILE"
SECRET_BYTES = 32
# A token file holds one token (a secret's 64 hex characters, or a Kubernetes Secret's value); a larger file is
# refused unread, not read into memory.
MAX_TOKEN_FILE_BYTES = 64 << 10


class TokenError(EngineError):
    """No usable job token; the message says what to do."""


def secret_path(settings: options.Options | None = None) -> Path:
    """The per-user secret file: ``$XDG_CONFIG_HOME/rdkeras/job-token`` or ``~/.config/rdkeras/job-token``."""
    settings = options.from_env() if settings is None else settings
    return settings.config_dir / "rdkeras" / "job-token"


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device", stat.S_IFLNK: "a symbolic link"}  # fmt: skip


def _check_folder(path: Path, what: str) -> None:
    """The folder holding a token must be writable by this user alone (else another user could put a token of
    their choosing there): owned by this user (or root, as a mounted secret's is), not group/world-writable."""
    folder = path.parent
    try:
        st = os.stat(folder)
    except OSError as e:
        raise TokenError(f"cannot read the folder of the {what} {path}: {e.strerror}") from None
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TokenError(
            f"the {what} {path} is in {folder}, which others can write (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}): someone else could put a token there. Keep it in a folder only you "
            f"can write (`chmod go-w {folder}`, or move the file)"
        )


def _read_private(path: Path, what: str) -> bytes:
    """The contents of `path`, which must be a regular file of this user's, closed to everyone else, in a folder
    only this user can write. Never blocks: a FIFO or a device is refused, not opened for reading."""
    _check_folder(path, what)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever (the type is checked next).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TokenError(f"the {what} {path} is a symbolic link: use the file it points to") from None
        raise TokenError(f"cannot read the {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise TokenError(f"the {what} {path} is {kind}: it must be a regular file holding the token")
        if st.st_uid != os.geteuid():
            raise TokenError(f"the {what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenError(
                f"the {what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}): anyone who can "
                f"read it can join your jobs. Run `chmod 600 {path}` (or delete it to get a new one)"
            )
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise _too_large(path, what, st.st_size)
        # Into one growing buffer (linear in the size), and no further than the cap if the file grows meanwhile.
        data = bytearray()
        while len(data) <= MAX_TOKEN_FILE_BYTES and (chunk := os.read(fd, MAX_TOKEN_FILE_BYTES + 1 - len(data))):
            data += chunk
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise _too_large(path, what, len(data))
    finally:
        os.close(fd)
    token = bytes(data).strip()
    if not token:
        raise TokenError(f"the {what} {path} is empty: delete it and rdkeras makes a new one")
    return token


def _too_large(path: Path, what: str, size: int) -> TokenError:
    return TokenError(
        f"the {what} {path} holds {size:,} bytes, more than a token file may ({MAX_TOKEN_FILE_BYTES:,}): it must "
        f"hold the token alone (rdkeras writes {2 * SECRET_BYTES} hex characters); check that it is the right file"
    )


def _create_secret(path: Path) -> None:
    """Writes a fresh secret to `path` unless it exists; safe against concurrent creators."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and fails if another rank got there first: theirs wins
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def user_secret(settings: options.Options | None = None) -> bytes:
    """This user's secret, created on first use (see the module docstring)."""
    path = secret_path(settings)
    if not os.path.lexists(path):
        try:
            _create_secret(path)
        except OSError as e:
            raise TokenError(
                f"no job token: cannot create {path} ({e.strerror}); set {ENV_TOKEN} (or {ENV_TOKEN_FILE}) "
                "to the same secret on every rank"
            ) from None
    return _read_private(path, "job-token file")


def resolve(world_size: int, job_key: str | None, settings: options.Options | None = None) -> bytes:
    """The token for this job's rendezvous.

    Args:
        world_size: Ranks in the job; a one-rank job needs no shared secret and gets a random one.
        job_key: What identifies this job on every rank (:func:`rdkeras.cluster.job_key`), or None
            where the environment names no job (then only an explicit token will do).
        settings: The ``RDKERAS_*`` settings (default: read from the environment).
    """
    settings = options.from_env() if settings is None else settings
    if settings.job_token:
        return settings.job_token.encode()
    if settings.job_token_file:
        return _read_private(Path(settings.job_token_file), f"{ENV_TOKEN_FILE} file")
    if world_size <= 1:
        return secrets.token_hex(16).encode()
    if job_key is None:
        raise TokenError(
            f"no job token: set {ENV_TOKEN} to the same secret on every rank, or launch through "
            "python -m rdkeras.launch, SLURM, TF_CONFIG or torchrun (they identify the job)"
        )
    digest = hmac.new(user_secret(settings), b"rdkeras-job|" + job_key.encode(), hashlib.sha256)
    return digest.hexdigest().encode()
