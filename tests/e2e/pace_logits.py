"""A vLLM logits processor that paces generation without changing it (vLLM 0.32 v1 API).

Loaded with `vllm serve ... --logits-processors tests.e2e.pace_logits:PaceSteps` (the checkout on the child's
PYTHONPATH).  While a request that opted in (`vllm_xargs = {"kimi_pace": 1}`) is in the batch, each engine step
takes at least PACE_S; the logits are returned untouched, so a greedy run's tokens are those of an unpaced one.
A test that must act mid-generation (tests/e2e/test_vllm_front.py kills EngineCore) then has at least
PACE_S per token left, whatever the machine's speed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.e2e.request_logits import PerRequest

PACE_S = 0.02


class PaceSteps(PerRequest[bool]):
    def pick(self, extra_args: dict[str, Any], prompt: list[int], output: list[int]) -> bool | None:
        return True if extra_args.get("kimi_pace") else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.requests:
            time.sleep(PACE_S)
        return logits
