"""A failing test's report shows the traceback of each error-level record its supervisors wrote.

The product swallows an exception in a reporting path (the operator view's `_never_fatal`) and logs it once as
`operator_view.error` with its traceback.  A test that then fails on the event's name alone says nothing of the
cause; this plugin appends every such record of the test's harness Runs (testkit/harness.py) to the failure.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from testkit import harness

SECTION = "kimi-supervisor error records"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    harness.STARTED = []  # this test's Runs only (and no earlier test's events kept alive)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and harness.STARTED:
        text = harness.error_records(harness.STARTED)
        if text:
            report.sections.append((SECTION, text))
