"""The suite's own plumbing: `make soak` selects what `make test` leaves out."""

import pytest


@pytest.mark.soak
def test_soak_marker_selects_long_runs() -> None:
    """Runs only under -m soak (make soak); make test deselects it."""


def test_short_runs_are_selected() -> None:
    """Runs under make test."""
