"""What the tests' vLLM logits processors share (vLLM 0.32 v1 API): a value per request that opted in, kept by its
batch index through vLLM's batch updates (added, removed, moved or swapped), and a step paced to at least a floor.

pace_logits.py, hold_logits.py and script_logits.py each say what a request opts in with (`pick`) and what a step
does with the values (`apply`)."""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

V = TypeVar("V")


class PerRequest(LogitsProcessor, Generic[V]):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        eos = vllm_config.model_config.hf_config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.requests: dict[int, V] = {}  # batch index -> the value of a request that opted in

    def is_argmax_invariant(self) -> bool:
        return False  # vLLM skips argmax-invariant processors for greedy requests: these must run

    def pick(self, extra_args: dict[str, Any], prompt: list[int], output: list[int]) -> V | None:
        """The value of a request added to the batch (its vllm_xargs, prompt ids, vLLM's live output list);
        None: it did not opt in."""
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            value = self.pick((params.extra_args or {}) if params is not None else {}, list(prompt or []), output)
            if value is None:
                self.requests.pop(index, None)
            else:
                self.requests[index] = value
        for a, b, direction in batch_update.moved:
            va, vb = self.requests.pop(a, None), self.requests.pop(b, None)
            if va is not None:
                self.requests[b] = va
            if direction == MoveDirectionality.SWAP and vb is not None:
                self.requests[a] = vb


def pace(started: float, floor_s: float) -> None:
    """Let the step that began at `started` take at least `floor_s`."""
    left = floor_s - (time.monotonic() - started)
    if left > 0:
        time.sleep(left)
