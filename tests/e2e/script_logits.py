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

from tests.e2e.request_logits import PerRequest, pace

PACE_S = 0.05  # a test kills EngineCore within a window of several tokens: a few steps of the client's lag


def position(script: list[int], prompt: list[int]) -> int:
    """How much of the script the prompt already ends with (0 for a request that starts it)."""
    for k in range(min(len(script), len(prompt)), 0, -1):
        if prompt[-k:] == script[:k]:
            return k
    return 0


class ScriptTokens(PerRequest[tuple[list[int], int, list[int]]]):
    """Per request: its script, the ids of the script before its output, its output ids (vLLM's live list)."""

    def pick(
        self, extra_args: dict[str, Any], prompt: list[int], output: list[int]
    ) -> tuple[list[int], int, list[int]] | None:
        raw = extra_args.get("kimi_script")
        if not raw:
            return None
        script = [int(i) for i in str(raw).split(",")]
        return script, position(script, prompt), output

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        started = time.monotonic()
        for index, (script, done, output) in self.requests.items():
            if index >= logits.shape[0]:
                continue
            at = done + len(output)
            logits[index, :] = float("-inf")
            logits[index, script[at] if at < len(script) else self.eos] = 0.0
        pace(started, PACE_S)
        return logits
