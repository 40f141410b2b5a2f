"""Certificates the tests need beyond what ``kvcached certs`` issues, made with the same code."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from kvcached.certs import CA_CERT, CA_KEY, issue_node


def expired_certificate(ca_dir: Path, into: Path, name: str) -> tuple[Path, Path]:
    """A certificate for ``name`` signed by the CA in ``ca_dir``, valid for nine days from ten days
    ago: expired yesterday. Issued in ``into`` (a copy of the CA goes there with it)."""
    into.mkdir(parents=True, exist_ok=True)
    for file in (CA_CERT, CA_KEY):
        shutil.copyfile(ca_dir / file, into / file)
    ten_days_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    return issue_node(into, name, days=9, valid_from=ten_days_ago)
