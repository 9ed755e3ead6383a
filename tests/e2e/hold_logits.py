"""A vLLM logits processor that lets a drain test decide when a real generation ends (vLLM 0.32 v1 API).

Loaded with `vllm serve ... --logits-processors tests.e2e.hold_logits:HoldUntilReleased` (the checkout on the
child's PYTHONPATH).  A request opts in with `vllm_xargs = {"kimi_hold": PATH}`; until PATH exists its EOS
token is masked and each engine step takes at least PACE_S, then EOS is forced: the generation ends (finish
reason "stop") one step after the test writes PATH, never before, whatever the machine's speed.  The pace
(~50 tokens/s, the seeds' Kimi measured ~60 per request) also keeps the tiny model from flooding the API
server's event loop, so /metrics answers while the stream runs.  Requests without it are untouched.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tests.e2e.request_logits import PerRequest, pace

PACE_S = 0.02


class HoldUntilReleased(PerRequest[str]):
    def pick(self, extra_args: dict[str, Any], prompt: list[int], output: list[int]) -> str | None:
        path = extra_args.get("kimi_hold")
        return str(path) if path else None  # its release file

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        started = time.monotonic()
        for index, path in self.requests.items():
            if index >= logits.shape[0]:
                continue
            if os.path.exists(path):
                logits[index, :] = float("-inf")
                logits[index, self.eos] = 0.0
            else:
                logits[index, self.eos] = float("-inf")
        pace(started, PACE_S)
        return logits
