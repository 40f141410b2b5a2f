"""Structured, quiet logging: one line per event, ``key=value`` (text) or one JSON object.

Callers pass fields with ``extra={"fields": {...}}``; messages stay short and fixed so logs can
be grepped and parsed. At the default level the daemon logs a handful of lines (start, each
listener, ready, stop) and every problem.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["setup_logging", "set_level", "fields", "LEVELS"]

LEVELS = ("debug", "info", "warning", "error")
_THIRD_PARTY = ("grpc", "asyncio", "aioquic", "quic")


def fields(**kv: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(a=1))``."""
    return {"fields": kv}


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"logger={record.name}", f"msg={_quote(record.getMessage())}"]
        parts += [f"{k}={_quote(v)}" for k, v in getattr(record, "fields", {}).items()]
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


def set_level(level: str, logger: str = "") -> str:
    """Set a logger's level (``""``: the daemon's root logger, and with it third-party chatter,
    which stays at warning unless the level is debug); returns the previous level's name."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}; got {level!r}")
    target = logging.getLogger(logger or None)
    previous = logging.getLevelName(target.getEffectiveLevel()).lower()
    target.setLevel(level.upper())
    if not logger:
        for name in _THIRD_PARTY:
            logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    return previous
