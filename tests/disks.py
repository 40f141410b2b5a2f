"""Real small and full filesystems for tests: a tmpfs of a given size, and a foreign file that
fills one to ENOSPC (something else filling the disk, as happens on real nodes)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount's syntax: "4m") at the new directory ``where``; skips the
    test where mounting is not allowed (it needs root). Unmounted (lazily) afterwards."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path, chunk: int = 4096) -> Path:
    """Fill the filesystem of ``directory`` with a file until it says ENOSPC; returns the file
    (remove it to make room again)."""
    hog = directory / "hog"
    with open(hog, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * chunk)
        except OSError:
            pass
    return hog
