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
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

PACE_S = 0.02


class HoldUntilReleased(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        eos = vllm_config.model_config.hf_config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.held: dict[int, str] = {}  # batch index -> release file

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.held.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            path = (params.extra_args or {}).get("kimi_hold") if params is not None else None
            if path:
                self.held[index] = str(path)
            else:
                self.held.pop(index, None)
        for a, b, direction in batch_update.moved:
            pa, pb = self.held.pop(a, None), self.held.pop(b, None)
            if pa is not None:
                self.held[b] = pa
            if direction == MoveDirectionality.SWAP and pb is not None:
                self.held[a] = pb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.held:
            return logits
        started = time.monotonic()
        for index, path in self.held.items():
            if index >= logits.shape[0]:
                continue
            if os.path.exists(path):
                logits[index, :] = float("-inf")
                logits[index, self.eos] = 0.0
            else:
                logits[index, self.eos] = float("-inf")
        left = PACE_S - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
        return logits
