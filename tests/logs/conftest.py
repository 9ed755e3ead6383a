"""The fake journald socket the journal and catalog tests log into, with structlog reset after each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from testkit.fakes.journal_socket import JournalSocket


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalSocket]:
    j = JournalSocket(tmp_path)
    yield j
    j.close()
    structlog.reset_defaults()
