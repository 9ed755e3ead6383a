"""The heavy tiers' xdist lanes (tests/conftest.py, docs/test-tiers.md "Lanes"): each heavy file whole
in one lane, the lanes balanced by the files' measured length, handed out before the unit tests, every list's own
order kept."""

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


def test_the_lanes_go_first_each_heavy_file_whole_in_one_and_the_unit_tests_keep_their_order() -> None:
    unit_a = Item("tests/cli/test_entry.py")
    cpu_1 = Item("tests/e2e/test_vllm_cpu.py")
    mn_systemd_1 = Item("tests/e2e/test_vllm_multinode_systemd.py", "multinode", "systemd")
    unit_b = Item("tests/test_faults.py")
    nspawn = Item("tests/nspawn/test_kimi_unit.py")
    mn_systemd_2 = Item("tests/e2e/test_vllm_multinode_systemd.py", "multinode", "systemd")
    mn = Item("tests/e2e/test_vllm_multinode_systemd_leader_first.py", "multinode", "systemd")
    cpu_2 = Item("tests/e2e/test_vllm_cpu.py")
    drain = Item("tests/e2e/test_vllm_drain.py")
    marked = Item("tests/config/test_timeouts.py", "systemd")  # a heavy tier's marker outside the heavy dirs
    items = [unit_a, cpu_1, mn_systemd_1, unit_b, nspawn, mn_systemd_2, mn, cpu_2, drain, marked]

    conftest.pytest_collection_modifyitems(cast(pytest.Config, Config()), cast(list[pytest.Item], items))

    heavy = [cpu_1, mn_systemd_1, nspawn, mn_systemd_2, mn, cpu_2, drain, marked]
    assert items[: len(heavy)] == sorted(items[: len(heavy)], key=lambda i: i.groups)  # a lane's tests together
    assert set(items[: len(heavy)]) == set(heavy)
    assert items[len(heavy) :] == [unit_a, unit_b]
    assert unit_a.groups == unit_b.groups == []
    assert all(len(item.groups) == 1 and item.groups[0].startswith(conftest.HEAVY_LANE_PREFIX) for item in heavy)
    assert mn_systemd_1.groups == mn_systemd_2.groups and cpu_1.groups == cpu_2.groups  # a file stays whole
    # The three longest files each start a lane of their own: the multi-node pair no longer shares one.
    assert len({mn_systemd_1.groups[0], mn.groups[0], drain.groups[0]}) == conftest.HEAVY_LANES == 3
    # Within a lane, a file's tests keep their order.
    assert items.index(mn_systemd_1) < items.index(mn_systemd_2) and items.index(cpu_1) < items.index(cpu_2)


def test_lanes_take_the_longest_files_first_each_to_the_lane_that_ends_soonest() -> None:
    seconds = {Path(f"f{n}.py"): s for n, s in enumerate([460, 210, 205, 150, 80, 70, 55, 45, 42, 28, 27, 15, 15])}

    lanes = conftest.heavy_lanes(seconds)

    assert sorted(p for paths in lanes.values() for p in paths) == sorted(seconds)  # every file once
    load = {name: sum(seconds[p] for p in paths) for name, paths in lanes.items()}
    assert lanes["heavy-1"][0] == Path("f0.py") and lanes["heavy-2"][0] == Path("f1.py")
    # Longest-first greedy: the last lane to end ends at most the mean plus the longest file it took last, and
    # here no later than the 460 s file with what fits beside it.
    assert max(load.values()) <= sum(seconds.values()) / 3 + max(seconds[paths[-1]] for paths in lanes.values())
    assert max(load.values()) - min(load.values()) <= 60, load
    assert conftest.heavy_lanes(seconds) == lanes  # the same every run: xdist's workers must agree


def test_files_that_share_a_session_fixture_share_a_lane_side_by_side() -> None:
    [(name, files)] = conftest.HEAVY_SHARED.items()
    assert name == "vllm_python" and len(files) == 4
    seconds = {Path("a.py"): 300, Path("b.py"): 290, Path("c.py"): 280, Path("d.py"): 5}
    seconds |= {Path(f): 10 for f in files}  # 10 s each: dealt one by one, they would go to three lanes

    lanes = conftest.heavy_lanes(seconds)

    [lane] = [paths for paths in lanes.values() if Path(files[0]) in paths]
    at = lane.index(Path(files[0]))
    assert lane[at : at + len(files)] == [Path(f) for f in files]  # together, in their order
    assert sorted(p for paths in lanes.values() for p in paths) == sorted(seconds)
    # The group counts as one 40 s unit: dealt before the 5 s file, to the lane that ended soonest.
    assert lanes["heavy-3"] == [Path("c.py"), *(Path(f) for f in files)], lanes
