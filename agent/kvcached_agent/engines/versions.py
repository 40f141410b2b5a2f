"""The engine releases kvcached's plug-ins are built for and tested against: the one place.

``make test`` installs exactly ``TESTED`` (``python -m kvcached_agent.engines.versions`` prints
the pins); each plug-in calls :func:`require` before it imports anything of its engine, so an
engine outside ``SUPPORTED`` fails at import with a message that names the range, instead of
deep inside an interface that changed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

__all__ = ["SUPPORTED", "TESTED", "UnsupportedEngine", "require"]

TESTED: dict[str, str] = {"vllm": "0.33.0", "sglang": "0.5.23"}
# [lowest, first unsupported): the plug-in interfaces both engines call experimental change
# between minor releases, so each range is the tested minor release.
SUPPORTED: dict[str, tuple[str, str]] = {"vllm": ("0.33.0", "0.34.0"), "sglang": ("0.5.23", "0.6.0")}


class UnsupportedEngine(ImportError):
    """The engine is missing or its version is outside the supported range."""


def _numbers(version: str) -> tuple[int, ...]:
    """Release numbers of a version string ('0.33.1rc1+cpu' -> (0, 33, 1))."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise UnsupportedEngine(f"cannot read the version {version!r}")
    return tuple(int(n) for n in match.group(0).split("."))


def supported(engine: str, version: str) -> bool:
    low, high = SUPPORTED[engine]
    return _numbers(low) <= _numbers(version) < _numbers(high)


def require(engine: str) -> str:
    """The installed version of ``engine``; UnsupportedEngine naming the range otherwise."""
    low, high = SUPPORTED[engine]
    try:
        version = metadata.version(engine)
    except metadata.PackageNotFoundError:
        raise UnsupportedEngine(f"kvcached's {engine} plug-in needs {engine} >={low},<{high} "
                                f"(tested with {TESTED[engine]}); {engine} is not installed") from None
    if not supported(engine, version):
        raise UnsupportedEngine(f"kvcached's {engine} plug-in supports {engine} >={low},<{high} (tested with "
                                f"{TESTED[engine]}); this is {engine} {version}")
    return version


if __name__ == "__main__":
    # `python -m kvcached_agent.engines.versions`: the pip pins of the tested releases.
    sys.stdout.write(" ".join(f"{name}=={version}" for name, version in TESTED.items()) + "\n")
