"""Modes of the directories and files the daemon owns, whatever umask it was started under.

The daemon's state (the index, the SSD block files) is private to the daemon's user:
directories 0700, files 0600. Nobody else needs it: engines and tools reach the daemon through
its sockets, whose own mode and group (``grpc.socket_mode``/``socket_group``, ``agent.mode``/
``group``) say who may connect; group read access to the state would only hand out the cached
KV bytes and the index. A directory created for a socket gets search permission (x: neither
list nor write) for the group and others the socket's mode admits, and the socket's group.

Two layers, because each covers what the other cannot:

- explicit modes: every directory is created by :func:`make_dirs` (``os.makedirs`` creates
  missing parents 0777 and its ``mode`` is masked by the umask), block files are opened 0600;
- the process umask, :data:`DAEMON_UMASK`, set by :func:`set_daemon_umask` when the daemon
  process starts: it covers the files RocksDB creates (0644 masked by the umask, no mode of
  ours to pass) and the instant between a socket's bind and its chmod.

At start :func:`check_state_dir` checks each state directory, the directories below it the
daemon made, and its ancestors; see its docstring for what is refused and what is tightened.
"""

from __future__ import annotations

import os
import stat

__all__ = ["DAEMON_UMASK", "PRIVATE_DIR", "UnsafeDirectory", "check_state_dir", "make_dirs", "set_daemon_umask",
           "socket_dir_mode"]

DAEMON_UMASK = 0o077      # files 0600 and directories 0700 unless a mode is set explicitly
PRIVATE_DIR = 0o700


class UnsafeDirectory(Exception):
    """A state directory other users could write to (or replace): the daemon will not use it.
    The message names the path, what is wrong and how to fix it."""


def set_daemon_umask() -> int:
    """Set the process umask to :data:`DAEMON_UMASK`; returns the one it replaces. Call once, from
    the daemon process's entry point (the umask is process-wide)."""
    return os.umask(DAEMON_UMASK)


def socket_dir_mode(socket_mode: int) -> int:
    """The mode of a directory created for a socket of ``socket_mode``: the daemon's user has
    all, the group and others only search (x) where the socket's mode lets them connect."""
    return PRIVATE_DIR | (0o010 if socket_mode & 0o060 else 0) | (0o001 if socket_mode & 0o006 else 0)


def make_dirs(path: str | os.PathLike[str], mode: int = PRIVATE_DIR, gid: int = -1) -> list[str]:
    """Create ``path`` and its missing parents, each with exactly ``mode`` and, for ``gid >= 0``,
    group ``gid``; returns the directories created (parents first). Directories that exist are
    left as they are (:func:`check_state_dir` judges them). Safe against a concurrent creator of
    the same path. Raises OSError (FileExistsError where something that is not a directory is
    in the way).

    ``mkdir`` is given ``mode & 0o700`` (masked by the umask, never wider), then the group is set,
    then the exact mode: at no instant is the directory open to more than ``mode`` allows."""
    path = os.path.abspath(os.fspath(path))
    missing: list[str] = []
    here = path
    while not os.path.isdir(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    created: list[str] = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode & PRIVATE_DIR)
        except FileExistsError:
            if os.path.isdir(directory):      # another thread or process made it meanwhile
                continue
            raise
        if gid >= 0:
            os.chown(directory, -1, gid)
        os.chmod(directory, mode)
        created.append(directory)
    return created


def check_state_dir(path: str | os.PathLike[str], levels: int = 0, uid: int | None = None) -> list[str]:
    """Check a state directory before the daemon uses it; returns the directories whose mode was
    tightened (to log). Raises :class:`UnsafeDirectory` when other users could write to it:

    - the directory, or one of the ``levels`` levels of directories below it (the ones the daemon
      made: the SSD tier's ``blocks/``, ``quarantine/`` and leaf directories), is writable by
      others (o+w) or owned by a user other than ``uid`` (default: the daemon's effective user):
      anyone could already have planted, renamed or deleted files in it, so the daemon will not
      guess what is left to trust. Symbolic links are followed (an operator may link a directory
      to another disk): the directory they lead to is what is checked;
    - an ancestor, of ``path`` as named or of where it leads, is writable by others without the
      sticky bit: anyone could replace the whole directory.

    A directory of ``uid`` with any other group or other bits (group write included: what earlier
    versions created under the systemd unit's ``UMask=0007``) is set to 0700. Only directories are
    listed, never the leaf directories' files, so this costs one ``stat`` per directory. ``path``
    must exist."""
    uid = os.geteuid() if uid is None else uid
    named = os.path.abspath(os.fspath(path))
    top = os.path.realpath(named)
    _check_ancestors(named, {named, top})
    tightened: list[str] = []
    _check_tree(top, levels, uid, tightened)
    return tightened


def _check_ancestors(named: str, paths: set[str]) -> None:
    ancestors: set[str] = set()
    for path in paths:
        here = os.path.dirname(path)
        while here not in ancestors:
            ancestors.add(here)
            here = os.path.dirname(here)
    for here in sorted(ancestors):
        st = os.stat(here)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(
                f"{here} (holding {named}) is writable by every user (mode {_mode(st)}) and has no sticky bit: "
                f"anyone could replace {named}. Fix: chmod o-w {here} (or chmod +t {here}), or move the directory")


def _check_tree(top: str, levels: int, uid: int, tightened: list[str]) -> None:
    pending = [(top, 0)]
    while pending:
        directory, depth = pending.pop()
        st = os.stat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDirectory(f"{directory} is not a directory")
        if st.st_uid != uid:
            raise UnsafeDirectory(
                f"{directory} is owned by {_user(st.st_uid)}, not by the user kvcached runs as ({_user(uid)}): that "
                f"user could plant or replace files in it. Fix: chown -R {_name(uid)} {top}, or run kvcached as its owner")
        if st.st_mode & stat.S_IWOTH:
            raise UnsafeDirectory(
                f"{directory} is writable by every user (mode {_mode(st)}): anyone could have planted, renamed or "
                f"deleted files in it. Check what it holds, then fix: find {top} -type d -exec chmod 0700 {{}} +")
        if st.st_mode & 0o077:
            os.chmod(directory, PRIVATE_DIR)
            tightened.append(f"{directory} ({_mode(st)} -> 0700)")
        if depth < levels:
            with os.scandir(directory) as entries:
                pending += [(e.path, depth + 1) for e in entries if e.is_dir()]


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _user(uid: int) -> str:
    name = _name(uid)
    return f"uid {uid}" if name == str(uid) else f"uid {uid} ({name})"
