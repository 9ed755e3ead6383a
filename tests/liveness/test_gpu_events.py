"""GPU XID / double-bit ECC events while serving: NVML's event set, the watcher, and the supervisor's exit 18."""

from __future__ import annotations

import ctypes
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ExitCode, GpuFailed
from kimi_supervisor.host.gpu import GpuEvent
from kimi_supervisor.host.nvml_counters import NvmlEventWatch
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.liveness.gpu_events import GpuEventWatcher, describe
from kimi_supervisor.logs.journal import ConsoleChildSink
from kimi_supervisor.states import State
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import fake_config, fake_tree_of
from tests.conftest import wait_for


@pytest.mark.parametrize(
    ("event", "text"),
    [
        (GpuEvent(3, "xid", 79), "GPU 3: XID 79: GPU has fallen off the bus"),
        (GpuEvent(0, "xid", 48), "GPU 0: XID 48: double-bit ECC error (uncorrectable memory error)"),
        (
            GpuEvent(1, "xid", 95),
            "GPU 1: XID 95: uncontained ECC error (every application on the GPU is affected: reset the GPU)",
        ),
        (GpuEvent(1, "xid", 94), "GPU 1: XID 94: contained ECC error (the affected application must restart)"),
        (GpuEvent(2, "xid", 43), "GPU 2: XID 43: GPU stopped processing (the application's channel faulted)"),
        (GpuEvent(2, "xid", 999), "GPU 2: XID 999: see NVIDIA's XID catalog"),
        (GpuEvent(5, "double_bit_ecc"), "GPU 5: double-bit (uncorrectable) ECC error"),
        (GpuEvent(-1, "gpu_lost"), "a GPU is lost (NVML: GPU is lost; fallen off the bus?)"),
    ],
)
def test_events_are_described_with_nvidias_meaning(event: GpuEvent, text: str) -> None:
    assert describe(event) == text


def watcher(probe: FakeGpuProbe, gpus: tuple[int, ...], log: RecordingLog) -> tuple[GpuEventWatcher, threading.Event]:
    woke = threading.Event()
    w = GpuEventWatcher(probe, gpus, (63, 92), woke.set, log)
    w.start()
    return w, woke


def test_an_xid_on_our_gpu_is_critical_and_fails() -> None:
    probe = FakeGpuProbe([FakeGpu(), FakeGpu()])
    log = RecordingLog()
    w, woke = watcher(probe, (0, 1), log)
    try:
        w.check()  # nothing yet
        probe.inject(GpuEvent(1, "xid", 79))
        assert woke.wait(2)  # the loop is woken, not left to its next timeout
        with pytest.raises(GpuFailed) as info:
            w.check()
        assert info.value.exit_code == ExitCode.GPU_FAILED
        assert info.value.message == "GPU failure while serving: GPU 1: XID 79: GPU has fallen off the bus"
        (level, event, fields) = log.records[-1]
        assert (level, event, fields["gpu"], fields["xid"]) == ("critical", "gpu.xid", 1, 79)
        assert log.events("gpu.events_watching") == [
            {"registered": "GPU 0: xid+double_bit_ecc; GPU 1: xid+double_bit_ecc"}
        ]
    finally:
        w.close()
    assert probe.watches[0].closed


def test_ignored_xids_are_logged_and_events_on_other_gpus_never_arrive() -> None:
    probe = FakeGpuProbe([FakeGpu(), FakeGpu(), FakeGpu()])
    log = RecordingLog()
    w, woke = watcher(probe, (0, 1), log)
    try:
        probe.inject(GpuEvent(2, "xid", 79))  # not one of ours (NVML only delivers registered devices)
        probe.inject(GpuEvent(0, "xid", 63))  # a row remap recorded: informational
        assert woke.wait(2)
        time.sleep(0.3)
        w.check()
        assert log.events("gpu.xid_ignored") == [
            {
                "gpu": 0,
                "xid": 63,
                "meaning": "GPU 0: XID 63: ECC page retirement or row remapping recorded (takes effect at the next "
                "reset)",
                "why": "in gpu_health.xid_ignored",
            }
        ]
        assert log.events("gpu.xid") == []
    finally:
        w.close()


def test_application_scoped_xids_are_logged_device_level_ones_fail() -> None:
    """NVML names no process: a stranger's MMU fault (XID 31) on a shared GPU must not stop our tree."""
    probe = FakeGpuProbe([FakeGpu(), FakeGpu()])
    log = RecordingLog()
    w, _ = watcher(probe, (0, 1), log)
    try:
        for xid in (31, 13, 43, 45, 68, 69, 8, 11):
            probe.inject(GpuEvent(0, "xid", xid))

        def logged() -> int:
            w.check()  # raises for an XID acted on: the test fails there
            return len(log.events("gpu.xid_application"))

        wait_for(lambda: logged() == 8, timeout=5)
        assert [e["xid"] for e in log.events("gpu.xid_application")] == [31, 13, 43, 45, 68, 69, 8, 11]
        first = log.events("gpu.xid_application")[0]
        assert first["meaning"] == (
            "GPU 0: XID 31: GPU memory page fault (MMU fault: usually an illegal address in the application)"
        )
        assert first["why"] == (
            "application-scoped: any process on the GPU raises it and NVML names none; vLLM fails on its own faults"
        )
        assert log.events("gpu.xid") == []
        for xid in (79, 48, 64, 74, 94, 95, 119, 120, 140, 999):
            probe.inject(GpuEvent(1, "xid", xid))
            raised = wait_for(lambda: _raises(w), timeout=2)
            assert isinstance(raised, GpuFailed) and raised.exit_code == ExitCode.GPU_FAILED, xid
            assert f"GPU 1: XID {xid}: " in raised.message
    finally:
        w.close()


def _raises(w: GpuEventWatcher) -> GpuFailed | None:
    try:
        w.check()
    except GpuFailed as exc:
        return exc
    return None


def test_no_event_support_is_a_warning_not_a_failure() -> None:
    probe = FakeGpuProbe([FakeGpu()])
    probe.event_error = "NVML event set: Not Supported"
    log = RecordingLog()
    w, _ = watcher(probe, (0,), log)
    w.check()
    w.close()
    assert log.events("gpu.events_unavailable") == [{"gpus": "0", "error": "NVML event set: Not Supported"}]
    probe = FakeGpuProbe([FakeGpu()])
    probe.event_kinds = ()
    log = RecordingLog()
    w, _ = watcher(probe, (0,), log)
    w.close()
    assert log.events("gpu.events_unsupported") != []


# -- NvmlEventWatch over pynvml ------------------------------------------------------------


class FakeNvmlEvents:
    """pynvml's event calls: two GPUs, the second without double-bit ECC events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.handles = [ctypes.c_void_p(0x1000), ctypes.c_void_p(0x2000)]
        self.registered: list[tuple[int, int]] = []
        self.queue: list[Any] = []
        self.waits_ms: list[int] = []  # each nvmlEventSetWait_v2's timeout
        self.freed = False
        xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
        supported = {0x1000: xid | dbe | pynvml.nvmlEventTypePState, 0x2000: xid}
        monkeypatch.setattr(pynvml, "nvmlEventSetCreate", lambda: "set")
        monkeypatch.setattr(pynvml, "nvmlDeviceGetSupportedEventTypes", lambda h: supported[h.value])

        def register(h: ctypes.c_void_p, mask: int, event_set: str) -> None:
            if not supported[h.value] & mask:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            self.registered.append((h.value or 0, mask))

        def wait(event_set: str, timeout_ms: int) -> Any:
            self.waits_ms.append(timeout_ms)
            if not self.queue:
                time.sleep(timeout_ms / 1000)
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            item = self.queue.pop(0)
            if isinstance(item, int):
                raise pynvml.NVMLError(item)
            return item

        def free(event_set: str) -> None:
            self.freed = True

        monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
        monkeypatch.setattr(pynvml, "nvmlEventSetWait_v2", wait)
        monkeypatch.setattr(pynvml, "nvmlEventSetFree", free)


def test_nvml_registers_what_each_gpu_supports_and_maps_events_back(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = FakeNvmlEvents(monkeypatch)
    watch = NvmlEventWatch({0: nv.handles[0], 1: nv.handles[1]})
    assert watch.registered == {0: ("xid", "double_bit_ecc"), 1: ("xid",)}
    assert nv.registered == [
        (0x1000, pynvml.nvmlEventTypeXidCriticalError),
        (0x1000, pynvml.nvmlEventTypeDoubleBitEccError),
        (0x2000, pynvml.nvmlEventTypeXidCriticalError),
    ]
    assert watch.wait(0.05) is None
    assert nv.waits_ms == [50]  # NVML's own wait, bounded by the caller's timeout (not a wall-clock bound here)
    nv.queue += [
        types.SimpleNamespace(device=nv.handles[1], eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79),
        types.SimpleNamespace(device=nv.handles[0], eventType=pynvml.nvmlEventTypeDoubleBitEccError, eventData=0),
        pynvml.NVML_ERROR_GPU_IS_LOST,
    ]
    assert watch.wait(1) == GpuEvent(1, "xid", 79)
    assert watch.wait(1) == GpuEvent(0, "double_bit_ecc", None)
    assert watch.wait(1) == GpuEvent(-1, "gpu_lost", None)
    watch.close()
    assert nv.freed


# -- the supervisor: an XID while serving ----------------------------------------------------


class Notes:
    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, str | int]]] = []

    def send(self, **fields: str | int) -> None:
        self.sent.append((time.monotonic(), fields))


# After READY the /health probe runs every HEALTH_S: a verdict that waited for a probe would come HEALTH_S after the
# event; from the event it comes at the event's own wake-up (liveness/gpu_events.py) or the loop's one-second
# heartbeat at the latest.  BOUND_S tells the two apart on any machine not stalled for BOUND_S; how soon within it
# is a benchmark's question, not a unit test's (issue 39: a 0.5 s bound here failed beside a second suite).
HEALTH_S, BOUND_S = 60.0, 20.0


def test_xid_while_serving_stops_the_tree_and_exits_18_without_waiting_for_a_probe(tmp_path: Path) -> None:
    cfg = load_config(
        fake_config(
            tmp_path,
            [],
            preflight={"gpus": [0, 1]},
            health={"interval_s": HEALTH_S},
            liveness={"canary_interval_s": 0, "stuck_after_s": 0},
        )
    )
    probe = FakeGpuProbe([FakeGpu(), FakeGpu()])
    log = RecordingLog()
    notes = Notes()
    devnull = open(os.devnull, "w")  # noqa: SIM115
    sup = Supervisor(
        cfg, Deps(probe, PsutilProcessTable(), notes, log, ConsoleChildSink(devnull), watchdog_s=4 * HEALTH_S)
    )
    injected: list[float] = []

    def inject() -> None:
        wait_for(lambda: sup.state.state is State.READY and log.events("gpu.events_watching"), timeout=30)
        injected.append(time.monotonic())
        probe.inject(GpuEvent(1, "xid", 95))

    threading.Thread(target=inject, daemon=True).start()
    try:
        with pytest.raises(GpuFailed) as info:
            sup.run()
        took = time.monotonic() - injected[0]
    finally:
        devnull.close()
    assert info.value.exit_code == 18
    stopping = next(at for at, f in notes.sent if f.get("STOPPING") == 1)
    assert stopping - injected[0] < BOUND_S, stopping - injected[0]  # from the event, not the next probe
    assert took < BOUND_S, took  # the verdict plus stopping the (fake) tree
    assert "GPU 1: XID 95: uncontained ECC error" in info.value.message
    crit = [r for r in log.records if r[1] == "gpu.xid"]
    assert crit and crit[0][0] == "critical" and crit[0][2]["xid"] == 95
    assert sup.state.history[-2:] == [State.STOPPING, State.FAILED]
    assert not [at for at, f in notes.sent if f.get("WATCHDOG") == 1 and at > stopping]  # none after the verdict
    assert fake_tree_of(str(tmp_path)) == []
    assert probe.watches[0].closed  # the event set is freed once the thread is done


def test_a_strangers_xid_31_while_serving_is_logged_and_the_tree_untouched_then_xid_48_exits_18(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        fake_config(tmp_path, [], preflight={"gpus": [0, 1]}, liveness={"canary_interval_s": 0, "stuck_after_s": 0})
    )
    probe = FakeGpuProbe([FakeGpu(), FakeGpu()])
    log = RecordingLog()
    notes = Notes()
    devnull = open(os.devnull, "w")  # noqa: SIM115
    sup = Supervisor(cfg, Deps(probe, PsutilProcessTable(), notes, log, ConsoleChildSink(devnull), watchdog_s=0.4))
    seen: dict[str, object] = {}

    def inject() -> None:
        wait_for(lambda: sup.state.state is State.READY and log.events("gpu.events_watching"), timeout=30)
        tree = {p.pid: p.create_time() for p in fake_tree_of(str(tmp_path))}
        probe.inject(GpuEvent(0, "xid", 31))  # another user's faulting kernel on our GPU 0
        wait_for(lambda: log.events("gpu.xid_application"), timeout=5)
        pings = len([f for _, f in notes.sent if f.get("WATCHDOG") == 1])
        wait_for(lambda: len([f for _, f in notes.sent if f.get("WATCHDOG") == 1]) > pings + 1, timeout=5)
        seen["state"] = sup.state.state
        seen["tree_same"] = {p.pid: p.create_time() for p in fake_tree_of(str(tmp_path))} == tree and bool(tree)
        probe.inject(GpuEvent(1, "xid", 48))  # a double-bit ECC error: the device itself

    threading.Thread(target=inject, daemon=True).start()
    try:
        with pytest.raises(GpuFailed) as info:
            sup.run()
    finally:
        devnull.close()
    assert seen == {"state": State.READY, "tree_same": True}  # still serving, still pinging, same processes
    assert info.value.exit_code == 18
    assert "GPU 1: XID 48: double-bit ECC error" in info.value.message
    [app] = log.events("gpu.xid_application")
    assert (app["gpu"], app["xid"]) == (0, 31)
    assert [r[2]["xid"] for r in log.records if r[1] == "gpu.xid"] == [48]
    assert fake_tree_of(str(tmp_path)) == []
