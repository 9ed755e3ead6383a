"""The heavy tiers' two xdist lanes (tests/conftest.py, docs/test-tiers.md "Where the time goes"): each heavy test
in its lane, the lanes handed out before the unit tests, every list's own order kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from tests import conftest

REPO = Path(__file__).resolve().parent.parent


class Item:
    """What the hook reads and writes of a pytest.Item: its path, its markers, the markers it adds."""

    def __init__(self, path: str, *markers: str) -> None:
        self.path = REPO / path
        self.markers = set(markers)
        self.groups: list[str] = []

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None

    def add_marker(self, marker: Any) -> None:
        assert marker.name == "xdist_group"
        self.groups.append(marker.args[0])


class Plugins:
    def hasplugin(self, name: str) -> bool:
        return name == "xdist"


class Config:
    pluginmanager = Plugins()


def test_the_lanes_go_first_each_heavy_test_in_its_own_and_the_unit_tests_keep_their_order() -> None:
    unit_a = Item("tests/cli/test_entry.py")
    e2e = Item("tests/e2e/test_vllm_cpu.py")
    mn_systemd = Item("tests/e2e/test_vllm_multinode_systemd.py", "multinode", "systemd")
    unit_b = Item("tests/test_faults.py")
    nspawn = Item("tests/nspawn/test_kimi_unit.py")
    mn = Item("tests/e2e/test_vllm_multinode.py", "multinode", "vllm")
    marked = Item("tests/config/test_timeouts.py", "systemd")  # a heavy tier's marker outside the heavy dirs
    items = [unit_a, e2e, mn_systemd, unit_b, nspawn, mn, marked]

    conftest.pytest_collection_modifyitems(cast(pytest.Config, Config()), cast(list[pytest.Item], items))

    assert items == [mn_systemd, mn, e2e, nspawn, marked, unit_a, unit_b]
    assert mn_systemd.groups == mn.groups == [conftest.MULTINODE_GROUP]
    assert e2e.groups == nspawn.groups == marked.groups == [conftest.HEAVY_GROUP]
    assert unit_a.groups == unit_b.groups == []
