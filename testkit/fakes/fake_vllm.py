#!/usr/bin/env python3
"""A fake ``vllm serve`` for testing kimi-supervisor against real processes (stdlib only).

Run it as a script, as the supervisor runs vLLM: ``python3 testkit/fakes/fake_vllm.py serve MODEL --port N
[flags]`` (``--help`` lists the flags). What a supervisor sees of vLLM, by module:

* fake_vllm_options.py: the command line; one frozen Config.
* fake_vllm_api.py: the main process (vLLM's APIServer): binds the port early, listens only once the
  engine is up, serves, shuts down on SIGTERM, dies with its engine; the after-ready modes.
* fake_vllm_tree.py: EngineCore and the tensor-parallel workers (real forked processes with vLLM's
  titles: ``VLLM::EngineCore``, ``VLLM::Worker_TP0`` ...), their load, failures and deaths.
* fake_vllm_http.py: /health, /ping, /version, /metrics, /v1/models, POST /v1/completions.
* fake_vllm_output.py: the output: excerpts of real vLLM 0.32 logs (tests/fixtures/vllm_cpu_0.32)
  replayed as the process's own, the progress bar, and the stress shapes (floods, long lines, bad UTF-8).
* fake_vllm_preload.py: ``fake_vllm.py preload ...``, the weight holder (`vllm preload`, docs/weight-holder.md).
* fake_vllm_proc.py: process identity, signals, sleeping that notices SIGTERM and parent death.

Adding a mode: a flag and a Config field in fake_vllm_options.py; the behaviour where it acts (a row in
``Main.after_ready`` for "S seconds after ready", a flag on ``fake_vllm_http.APP`` read by a route for
an HTTP answer, a branch in ``fake_vllm_tree`` for the load); a test in tests/testkit/test_fake_vllm.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

if __package__ in (None, ""):
    # Run as a script: make `testkit.fakes` importable from the checkout this file is in.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.fakes.fake_vllm_api import Main
from testkit.fakes.fake_vllm_options import parse_config


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "preload":  # the weight holder (fake_vllm_preload.py)
        from testkit.fakes.fake_vllm_preload import main as preload

        preload(args[1:])
    Main(parse_config(args)).run()


if __name__ == "__main__":
    main()
