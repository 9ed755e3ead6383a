"""The tree stop on a fake clock (tests/fakes/lifecycle.py's child and clock), and the GPU-release wait."""

from __future__ import annotations

import signal

from kimi_supervisor.gpu import GpuMemory, GpuUnavailable
from kimi_supervisor.stopping import TERM_POLL_S, TreeStopper, confirm_gpus_free
from kimi_supervisor.timeouts import SIGKILL_WAIT_S
from tests.fakes.clock import FakeClock, RecordingLog
from tests.fakes.gpu import FakeGpu, FakeGpuProbe
from tests.fakes.lifecycle import EventClock, FakeChild


class Scene:
    """A stopper over a FakeChild; `signal_at(t)` is a second stop signal arriving t seconds in."""

    def __init__(self, term_exit_after: float | None, child: type[FakeChild] = FakeChild) -> None:
        self.clock = EventClock()
        self.child = child(self.clock, term_exit_after)
        self.log = RecordingLog()
        self.finished = 0
        self._signalled = False
        self.stopper = TreeStopper(self.child, self.clock.wait, self._finish, self._hurry, self.clock, self.log)

    def _finish(self) -> None:
        self.finished += 1

    def _hurry(self) -> bool:
        fresh, self._signalled = self._signalled, False
        return fresh

    def signal_at(self, t: float) -> None:
        self.clock.at(t, lambda: setattr(self, "_signalled", True))

    def sent(self) -> list[tuple[float, signal.Signals]]:
        return [(round(t, 2), sig) for t, sig in self.child.signals]


def test_a_child_that_exits_on_sigterm_is_gone_without_sigkill() -> None:
    scene = Scene(0.3)
    assert scene.stopper.stop(grace_s=30, second_grace_s=2) is True
    assert scene.sent() == [(0, signal.SIGTERM)]
    assert scene.stopper.stopped and scene.finished == 1
    assert scene.log.events("stop.tree_gone")[0]["exit_status"] == -signal.SIGTERM


def test_a_second_signal_cuts_the_grace_to_second_grace() -> None:
    scene = Scene(None)  # ignores SIGTERM
    scene.signal_at(1.0)
    assert scene.stopper.stop(grace_s=30, second_grace_s=0.5) is True
    (t_term, term), (t_kill, kill) = scene.child.signals
    assert (t_term, term, kill) == (0, signal.SIGTERM, signal.SIGKILL)
    assert 1.5 <= t_kill <= 1.5 + TERM_POLL_S  # at the first look after the cut deadline, not at 30 s
    assert scene.log.events("stop.hurry")[0]["grace_left_s"] == 0.5
    assert scene.log.events("stop.sigkill")[0]["after_s"] == round(t_kill, 2)


class Unkillable(FakeChild):
    """A process in uninterruptible sleep (D state): it outlives even SIGKILL."""

    def signal_tree(self, sig: signal.Signals) -> int:
        self.signals.append((self._clock.t, sig))
        return 1


def test_survivors_of_sigkill_are_named_and_the_tree_not_called_stopped() -> None:
    scene = Scene(None, Unkillable)
    assert scene.stopper.stop(grace_s=2, second_grace_s=1) is False
    (t_term, term), (t_kill, kill) = scene.child.signals
    assert (t_term, term, kill) == (0, signal.SIGTERM, signal.SIGKILL)
    assert 2 <= t_kill <= 2 + TERM_POLL_S
    assert scene.clock.t >= t_kill + SIGKILL_WAIT_S  # the SIGKILL wait ran out too
    assert scene.log.events("stop.survivors")[0]["pids"] == "4242"
    assert scene.log.events("stop.tree_left") and not scene.log.events("stop.tree_gone")
    assert not scene.stopper.stopped and scene.finished == 1


def test_emergency_kills_and_reaps_when_the_orderly_stop_raises_too() -> None:
    scene = Scene(None)
    reaped: list[bool] = []
    scene.child.reap = lambda: reaped.append(True)  # type: ignore[method-assign]

    def broken_pump(timeout: float) -> None:
        raise BrokenPipeError(32, "Broken pipe")  # the same broken sink that ended the run

    scene.stopper.pump = broken_pump
    scene.stopper.emergency(grace_s=30, second_grace_s=2)  # raises nothing
    assert scene.sent() == [(0, signal.SIGTERM), (0, signal.SIGKILL)]
    assert scene.child.returncode == -signal.SIGKILL and reaped == [True]


def test_emergency_swallows_a_failing_sigkill_too() -> None:
    scene = Scene(None)

    def refuse(sig: signal.Signals) -> int:
        raise PermissionError(1, "Operation not permitted")

    reaped: list[bool] = []
    scene.child.signal_tree = refuse  # type: ignore[method-assign]
    scene.child.reap = lambda: reaped.append(True)  # type: ignore[method-assign]
    scene.stopper.emergency(grace_s=30, second_grace_s=2)  # raises nothing: the run's own exception matters
    assert reaped == [True]  # a failed SIGKILL does not skip the reap


class LostGpu(FakeGpuProbe):
    def memory(self, index: int) -> GpuMemory:
        raise GpuUnavailable(f"GPU {index} memory: GPU is lost")


def test_gpu_release_confirmed_refused_or_unknown() -> None:
    log = RecordingLog()
    assert confirm_gpus_free(FakeGpuProbe([FakeGpu(), FakeGpu()]), (0, 1), 1000, 0.2, FakeClock(), log) is True
    assert log.events("stop.gpu_released")[0]["gpus"] == "0,1"
    busy = FakeGpuProbe([FakeGpu(), FakeGpu(base_used_mib=5000)])
    assert confirm_gpus_free(busy, (0, 1), 1000, 0.2, FakeClock(), log) is False
    assert log.events("stop.gpu_still_busy")[0]["gpus"] == "GPU 1: 5000 MiB"
    assert confirm_gpus_free(LostGpu([FakeGpu()]), (0,), 1000, 0.2, FakeClock(), log) is None
    assert log.events("stop.gpu_unknown")[0]["error"] == "GPU 0 memory: GPU is lost"
