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
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

PACE_S = 0.02


class PaceSteps(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.paced: set[int] = set()  # batch indices of the requests that opted in

    def is_argmax_invariant(self) -> bool:
        return False  # vLLM skips argmax-invariant processors for greedy requests: this one must run

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.paced.discard(index)
        for index, params, _prompt, _output in batch_update.added:
            if params is not None and (params.extra_args or {}).get("kimi_pace"):
                self.paced.add(index)
            else:
                self.paced.discard(index)
        for a, b, direction in batch_update.moved:
            had_a, had_b = a in self.paced, b in self.paced
            self.paced.discard(a)
            self.paced.discard(b)
            if had_a:
                self.paced.add(b)
            if direction == MoveDirectionality.SWAP and had_b:
                self.paced.add(a)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.paced:
            time.sleep(PACE_S)
        return logits
