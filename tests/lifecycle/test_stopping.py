"""The tree stop on a fake clock (testkit/fakes/lifecycle.py's child and clock), and the GPU-release wait."""

from __future__ import annotations

import signal

from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
from kimi_supervisor.host.gpu import GpuMemory, GpuUnavailable
from kimi_supervisor.lifecycle.drain import Drain, stopped_headline
from kimi_supervisor.lifecycle.reactor import Reactor
from kimi_supervisor.lifecycle.stopping import TERM_POLL_S, TreeStopper, confirm_gpus_free
from kimi_supervisor.liveness.http import Answer, HttpClient
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle import FakeChild, FakeSelector, FakeSignals
from testkit.fakes.log import RecordingLog


class Scene:
    """A stopper over a FakeChild and a reactor on the fake clock; `signal_at(t)` is a second stop signal
    arriving t seconds in."""

    def __init__(self, term_exit_after: float | None, child: type[FakeChild] = FakeChild) -> None:
        self.clock = FakeClock()
        self.child = child(self.clock, term_exit_after)
        self.log = RecordingLog()
        self.finished = 0
        self.signals = FakeSignals()
        self.reactor = Reactor(self.signals, self.log, FakeSelector(self.clock), now=self.clock.monotonic)
        self.stopper = TreeStopper(self.child, self.reactor, self, self.log)

    def finish(self) -> None:
        self.finished += 1

    def signal_at(self, t: float) -> None:
        self.clock.at(t, lambda: self.signals.send(signal.SIGTERM))

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

    def broken_turn(timeout: float) -> int:
        raise BrokenPipeError(32, "Broken pipe")  # the same broken sink that ended the run

    scene.reactor.run_once = broken_turn  # type: ignore[method-assign]
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


def test_gpu_release_leaves_out_the_weight_holders_memory() -> None:
    """docs/weight-holder.md: the deployment's weight holder keeps its weights when the engine stops; the stop does not
    wait `gpu_release_timeout_s` for memory that stays by design, and still waits for anything else."""
    log = RecordingLog()
    held = FakeGpuProbe([FakeGpu(base_used_mib=72500), FakeGpu(base_used_mib=72500)])
    assert confirm_gpus_free(held, (0, 1), 1000, 0.2, FakeClock(), log, {0: 72500, 1: 72500}) is True
    more = FakeGpuProbe([FakeGpu(base_used_mib=72500), FakeGpu(base_used_mib=80000)])
    assert confirm_gpus_free(more, (0, 1), 1000, 0.2, FakeClock(), log, {0: 72500, 1: 72500}) is False
    assert log.events("stop.gpu_still_busy")[0]["gpus"] == "GPU 1: 80000 MiB"


# -- the drain's outcome says what happened (the real Drain on the fake clock, /metrics a fake client) ------


def _metrics_client(running: float) -> HttpClient:
    page = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0.0\n".encode()

    def get(method: str, url: str, timeout_s: float, **kw: object) -> Answer:
        return Answer(200, page, None, 0.0, 0.0)

    return get  # type: ignore[return-value]  # the keywords a fake ignores


def _drain_scene(term_exit_after: float | None, running: float) -> tuple[Scene, Drain, list[str]]:
    scene = Scene(term_exit_after)
    statuses: list[str] = []

    class Notes:
        def send(self, **fields: str | int) -> None:
            if "STATUS" in fields:
                statuses.append(str(fields["STATUS"]))

    drain = Drain(
        "http://127.0.0.1:1/health",
        10,
        Notes(),
        scene.log,
        http=_metrics_client(running),
        clock=scene.clock.monotonic,
    )
    return scene, drain, statuses


def test_a_main_sigkilled_with_a_request_in_flight_is_killed_not_drained() -> None:
    # vLLM ignores its SIGTERM with 1 request in flight; a second stop signal cuts the grace to 0.5 s, inside
    # vLLM's own 10 s deadline.  Was: outcome=drained (1.5 s <= 10 s), though the request was cut by SIGKILL.
    scene, drain, statuses = _drain_scene(None, running=1.0)
    scene.signal_at(1.0)
    assert scene.stopper.stop(grace_s=30, second_grace_s=0.5, drain=drain) is True
    (record,) = scene.log.events("stop.drain")
    assert record["outcome"] == "killed"
    assert record["in_flight_at_sigterm"] == 1.0 and record["in_flight_at_sigkill"] == 1.0
    assert record["in_flight_source"] == "read at SIGTERM"
    assert 1.5 <= record["drain_s"] <= 1.5 + TERM_POLL_S
    assert statuses[-1] == "stopping: SIGKILL to vLLM after 2s of draining (1 request in flight)"
    assert stopped_headline(True, None, drain.outcome) == (
        "stopping: tree gone (drain cut: vLLM was SIGKILLed, see stop.drain)"
    )


def test_a_main_that_exits_by_itself_within_its_deadline_drained() -> None:
    scene, drain, _ = _drain_scene(2.0, running=1.0)
    assert scene.stopper.stop(grace_s=30, second_grace_s=0.5, drain=drain) is True
    (record,) = scene.log.events("stop.drain")
    assert record["outcome"] == "drained" and record["in_flight_at_sigkill"] is None
    assert 2.0 <= record["drain_s"] <= 2.0 + TERM_POLL_S
    assert scene.log.events("stop.sigkill") == []
    assert stopped_headline(True, None, drain.outcome) == "stopping: tree gone"
