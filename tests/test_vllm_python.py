"""The shared interpreter that answers the real-vLLM tier's questions to vLLM's own code (tests/e2e/vllm_python.py),
here with this interpreter: each question runs as `python -c` would, apart from the others."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.vllm_python import VllmPython


@pytest.fixture
def server() -> Iterator[VllmPython]:
    s = VllmPython(Path(sys.executable))
    try:
        yield s
    finally:
        s.close()


def test_argv_stdin_and_output_are_each_questions_own(server: VllmPython) -> None:
    first = server.run(
        "import sys; print(sys.argv[1:], sys.stdin.read()); print('e', file=sys.stderr)", ["a", "b"], "in"
    )
    assert (first.returncode, first.stdout, first.stderr) == (0, "['a', 'b'] in\n", "e\n")
    second = server.run("import sys; print(sys.argv[1:], repr(sys.stdin.read()))")
    assert (second.returncode, second.stdout, second.stderr) == (0, "[] ''\n", "")


def test_exit_status_and_a_traceback_are_the_questions(server: VllmPython) -> None:
    assert server.run("raise SystemExit(3)").returncode == 3
    assert server.run("import sys; sys.exit('bad')").returncode == 1
    assert server.run("raise SystemExit").returncode == 0
    failed = server.run("def f():\n    raise ValueError('boom')\nf()", filename="q.py")
    assert failed.returncode == 1
    assert 'File "q.py", line 2, in f' in failed.stderr and "ValueError: boom" in failed.stderr
    assert server.run("print('still here')").stdout == "still here\n"  # the server outlived them


def test_each_question_starts_from_a_fresh_namespace_as_main(server: VllmPython) -> None:
    assert server.run("x = 1\nprint(__name__)").stdout == "__main__\n"
    assert server.run("print('x' in globals())").stdout == "False\n"


def test_writes_past_sys_stdout_never_reach_an_answer(server: VllmPython) -> None:
    """What a logger bound at import or a C library writes to the process's stdout goes to the server's log."""
    noisy = server.run("import os; os.write(1, b'noise\\n'); print('answer')")
    assert noisy.stdout == "answer\n"
    assert server.run("print('next')").stdout == "next\n"  # the protocol kept its lines
    assert "noise" in server.log.read_text()


def test_a_server_that_died_is_an_error_naming_its_log(server: VllmPython) -> None:
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(AssertionError, match="vLLM's python has exited"):
        server.run("print(1)", timeout=5)
