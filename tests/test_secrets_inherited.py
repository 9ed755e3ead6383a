"""Secrets from the supervisor's own environment, KEY=VALUE argv items, overlaps and the 16 KiB cut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kimi_supervisor.child.process import LineSplitter
from kimi_supervisor.redact import is_secret_name, redact_argv, redact_text, secrets_of
from testkit.harness import REPO, Run, write_config

TOKEN = "hf_Inherited5ecretT0ken"
KEY = "sk-argv-key-0123456789"


def test_secret_names_by_their_parts() -> None:
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "OPENAI_API_KEY",
        "DB_PASSWORD",
        "--api-key",
        "--hf-token",
        "--ssl-keyfile-password",
        "GITHUB_TOKEN",
        "HFTOKEN",
        "VLLM_APIKEY",
    ):
        assert is_secret_name(name), name
    # Before: any name containing TOKEN/KEY: "false" (TOKENIZERS_PARALLELISM) vanished from every line, and
    # `--max-num-batched-tokens 8192` hid "8192"; the flag `--skip-tokenizer-init` hid the argument after it.
    for name in (
        "TOKENIZERS_PARALLELISM",
        "--max-num-batched-tokens",
        "--skip-tokenizer-init",
        "--tokenizer",
        "PYTHON_KEYRING_BACKEND",
        "--ssl-keyfile",
        "--allow-credentials",
        "KV_CACHE",
    ):
        assert not is_secret_name(name), name


def test_argv_items_and_options() -> None:
    # (argv item, as redacted)
    items = [
        ("env", "env"),
        (f"HF_TOKEN={TOKEN}", "HF_TOKEN=<redacted>"),
        ("NCCL_PROTO=LL", "NCCL_PROTO=LL"),
        ("vllm", "vllm"),
        ("serve", "serve"),
        ("/m", "/m"),
        ("--skip-tokenizer-init", "--skip-tokenizer-init"),
        ("--port", "--port"),
        ("8000", "8000"),
        ("--ssl-keyfile-password", "--ssl-keyfile-password"),
        ("pw-12345", "<redacted>"),
        (f"--api-key={KEY}", "--api-key=<redacted>"),
        ("--max-num-batched-tokens", "--max-num-batched-tokens"),
        ("8192", "8192"),
    ]
    argv = [item for item, _ in items]
    assert redact_argv(argv) == [redacted for _, redacted in items]
    assert secrets_of(argv) == (TOKEN, KEY, "pw-12345")


def test_overlapping_secrets_longest_first() -> None:
    # Before: replaced in config order, `abcd` first left "EFGHIJ" of the longer one.
    assert redact_text("a=abcdEFGHIJ b=abcd", ["abcd", "abcdEFGHIJ"]) == "a=<redacted> b=<redacted>"
    assert secrets_of([], {"A_TOKEN": "abcd", "B_TOKEN": "abcdEFGHIJ", "C_TOKEN": "abc"}) == ("abcdEFGHIJ", "abcd")


def test_secret_across_the_16k_cut_is_redacted_before_cutting() -> None:
    # Before: the cut came first, so the token's head survived at the end of the kept 16 KiB.
    line = b"x" * (16 * 1024 - 6) + TOKEN.encode() + b"y" * 100 + b"\n"
    for chunks in ([line], [line[:9000], line[9000:16380], line[16380:]]):
        splitter = LineSplitter(secrets=[TOKEN])
        out = [x for c in chunks for x in splitter.feed(c)] + splitter.close()
        assert len(out) == 1
        assert TOKEN[:6] not in out[0]
        assert out[0].startswith("x" * (16 * 1024 - 6) + "<redac [line cut: ")
    splitter = LineSplitter(secrets=[TOKEN])
    assert splitter.feed(f"short {TOKEN} line\n".encode()) == ["short <redacted> line"]
    # A line that is only over the limit because of the token fits once redacted: nothing is cut.
    fits = b"z" * (16 * 1024 - 10) + TOKEN.encode() + b"\n"
    assert LineSplitter(secrets=[TOKEN]).feed(fits) == ["z" * (16 * 1024 - 10) + "<redacted>"]


def test_inherited_token_never_in_child_lines_failure_status_or_logs(tmp_path: Path) -> None:
    child = tmp_path / "child.py"
    child.write_text(
        "import os, sys\n"
        "t = os.environ['HF_TOKEN']\n"
        "print('loading with token=' + t, flush=True)\n"
        "print('x' * (16 * 1024 - 6) + t + 'tail', flush=True)\n"
        "print('ERROR 11-29 21:00:00 [core.py:700] Engine core initialization failed: bad token ' + t, flush=True)\n"
        "sys.exit(1)\n"
    )
    cfg = write_config(
        tmp_path / "k.toml",
        {
            "child": {"argv": [sys.executable, str(child), "--port", "8"]},
            "preflight": {"gpus": [], "check_model": False, "check_port": False},
            "preflight.shm": {"enabled": False},
            "shutdown": {"grace_s": 2, "gpu_release_timeout_s": 0},
        },
    )
    run = Run(cfg, tmp_path, env={"HF_TOKEN": TOKEN})
    assert run.wait() == 11
    lines = [c["line"] for c in run.child_lines]
    assert "loading with token=<redacted>" in lines
    everything = (
        json.dumps(run.events)
        + json.dumps(run.child_lines)
        + "\n".join(run.raw_stderr)
        + "\n".join(run.notify.messages())
    )
    assert TOKEN[:6] not in everything
    failed = [f["STATUS"] for f in run.notify.fields() if f.get("STATUS", "").startswith("failed")]
    root_cause = "ERROR 11-29 21:00:00 [core.py:700] Engine core initialization failed: bad token <redacted>"
    assert failed == [f'failed: vLLM exited with status 1 before it was ready: "{root_cause}"']


def test_check_config_hides_argv_assignments_and_inherited_values(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'[child]\nargv = ["env", "HF_TOKEN={TOKEN}", "vllm", "serve", "/models/{KEY}"]\n')
    result = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "check-config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OPENAI_API_KEY": KEY},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert 'child.argv = ["env", "HF_TOKEN=<redacted>", "vllm", "serve", "/models/<redacted>"]' in result.stdout
    assert TOKEN not in result.stdout and KEY not in result.stdout
