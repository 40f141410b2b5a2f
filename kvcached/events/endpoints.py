"""Binding and unbinding the ZMQ endpoints of the event streams (a thin layer over pyzmq).

An ``ipc://`` endpoint is bound under a temporary name, given its mode (and, for a tenant's
stream, the ACL that admits the tenant alone), then renamed into place, so nobody can connect
before it is what it must be. libzmq removes the name it bound when the socket closes, which
after the rename no longer exists: the path is removed here instead, only if it is still the
file this process bound (:func:`unbind`), so a socket bound again at the same path (a replay
endpoint's reset, a successor at an upgrade) is never removed by the one that closed.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import zmq

from kvcached.tenants.socket_acl import admit_only

__all__ = ["Bound", "bind", "unbind"]

Bound = tuple[str, int] | None        # an ipc endpoint's (path, inode); None for tcp
_BINDS = itertools.count()            # each bind's temporary name is its own (a closing socket removes its own)


def bind(sock: zmq.Socket[bytes], endpoint: str, key: str, admit: tuple[list[int], list[int]] | None = None) -> Bound:
    """Bind ``endpoint`` (OSError naming ``key`` if it cannot be); with ``admit`` (uids, gids),
    an ipc endpoint only they (and the daemon's user) may open."""
    if not endpoint.startswith("ipc://"):
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"{key} {endpoint}: {exc.strerror}") from None
        return None
    path = endpoint[len("ipc://"):]
    temporary = os.path.join(os.path.dirname(path), f".kv{os.getpid()}-{next(_BINDS)}")
    with contextlib.suppress(FileNotFoundError):       # one left by a process that died just here
        os.unlink(temporary)
    try:
        sock.bind(f"ipc://{temporary}")
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"{key} {endpoint}: {exc.strerror}") from None
    try:
        if admit is not None:
            admit_only(temporary, *admit)
        else:
            os.chmod(temporary, 0o600)
        os.rename(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):      # no socket left under a temporary name
            os.unlink(temporary)
        raise OSError(exc.errno, f"{key} {endpoint}: {exc.strerror or exc}") from None
    return path, os.stat(path).st_ino


def unbind(bound: Bound) -> None:
    """Remove an ipc endpoint's path if it is still the file :func:`bind` made."""
    if bound is None:
        return
    path, inode = bound
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass
