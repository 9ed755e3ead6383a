"""A vLLM logits processor that makes a greedy generation follow a script of token ids (vLLM 0.32 v1 API).

Loaded with `vllm serve ... --logits-processors tests.e2e.script_logits:ScriptTokens` (the checkout on the child's
PYTHONPATH).  A request opts in with `vllm_xargs = {"kimi_script": "ID,ID,..."}`: each step forces the script's
next id, then EOS once the script is spent, so a tiny random model writes Kimi's reasoning, `</think>` and tool-call
section (tests/e2e/make_tiny_model.py --kimi) as the real model would.  A continuation (the front's resume: the
prompt followed by the ids already generated) goes on where the script was: the script's position counts the
longest script prefix that ends its prompt.  Each step takes at least PACE_S, so a test can kill EngineCore at a
chosen point whatever the machine's speed.  Requests without it are untouched.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

PACE_S = 0.05  # a test kills EngineCore within a window of several tokens: a few steps of the client's lag


def position(script: list[int], prompt: list[int]) -> int:
    """How much of the script the prompt already ends with (0 for a request that starts it)."""
    for k in range(min(len(script), len(prompt)), 0, -1):
        if prompt[-k:] == script[:k]:
            return k
    return 0


class ScriptTokens(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        eos = vllm_config.model_config.hf_config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        # batch index -> (script, ids of the script before this request's output, its output ids: vLLM's live list)
        self.scripted: dict[int, tuple[list[int], int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.scripted.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            raw = (params.extra_args or {}).get("kimi_script") if params is not None else None
            if raw:
                script = [int(i) for i in str(raw).split(",")]
                self.scripted[index] = (script, position(script, list(prompt or [])), output)
            else:
                self.scripted.pop(index, None)
        for a, b, direction in batch_update.moved:
            sa, sb = self.scripted.pop(a, None), self.scripted.pop(b, None)
            if sa is not None:
                self.scripted[b] = sa
            if direction == MoveDirectionality.SWAP and sb is not None:
                self.scripted[a] = sb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.scripted:
            return logits
        started = time.monotonic()
        for index, (script, done, output) in self.scripted.items():
            if index >= logits.shape[0]:
                continue
            at = done + len(output)
            logits[index, :] = float("-inf")
            logits[index, script[at] if at < len(script) else self.eos] = 0.0
        left = PACE_S - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
        return logits
