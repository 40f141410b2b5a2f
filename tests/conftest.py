"""What every suite shares: the longest tests run first."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (tens of seconds each) first, the rest in their order: ``make test``
    runs the main suite in several processes (pytest-xdist), and a long test left to the end would
    run alone while the other processes sit idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
