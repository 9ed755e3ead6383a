"""A vLLM logits processor that paces generation without changing it (vLLM 0.32 v1 API).

Loaded with `vllm serve ... --logits-processors tests.e2e.pace_logits:PaceSteps` (the checkout on the child's
PYTHONPATH).  While a request that opted in (`vllm_xargs = {"kimi_pace": 1}`) is in the batch, each engine step
takes at least PACE_S; the logits are returned untouched, so a greedy run's tokens are those of an unpaced one.
A test that must act mid-generation (tests/e2e/test_vllm_front.py kills EngineCore) then has at least
PACE_S per token left, whatever the machine's speed.

A request may also name a file that stalls the batch (`vllm_xargs = {"kimi_pace": 1, "kimi_stall_while": PATH}`):
while PATH exists no step of a batch holding it ends (bounded by STALL_MAX_S, a hang's bound), so a stream cannot
end before the test removes PATH, whatever the machine's speed or how long a `systemctl restart` takes to reach
vLLM (tests/e2e/test_vllm_front_systemd.py: the clients write PATH once every stream is open).  Stalling changes
when tokens come, never which.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tests.e2e.request_logits import PerRequest

PACE_S = 0.02
STALL_POLL_S = 0.05
STALL_MAX_S = 900.0


class PaceSteps(PerRequest[str]):
    """Per request: the file that stalls its batch while it exists ("": none)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.stalled_since: dict[str, float] = {}  # a stall file -> when it first stalled a step

    def pick(self, extra_args: dict[str, Any], prompt: list[int], output: list[int]) -> str | None:
        if not extra_args.get("kimi_pace"):
            return None
        return str(extra_args.get("kimi_stall_while") or "")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        while stalling := [path for path in set(self.requests.values()) if path and os.path.exists(path)]:
            now = time.monotonic()
            if all(now - self.stalled_since.setdefault(path, now) > STALL_MAX_S for path in stalling):
                break  # a hang's bound, over the whole stall (not a step's): the test that left it has failed
            time.sleep(STALL_POLL_S)
        time.sleep(PACE_S)
        return logits
