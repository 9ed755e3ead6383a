"""Config: every error class gives one exact line naming file and key; defaults are sane."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config.load import effective_config, load_config, parse_config
from kimi_supervisor.exitcodes import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[2]
MINIMAL = '[child]\nargv = ["vllm", "serve", "/m"]\n'


def write(tmp_path: Path, text: str | bytes, name: str = "k.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.exit_code == ExitCode.CONFIG
    message = info.value.message
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "{p}: the file is empty; required key 'child.argv' is missing"),
        ('[child]\nargv = ["a",\n', "{p}: invalid TOML: Invalid value (at end of document)"),
        ('[child]\nargv = ["vllm"]\nx = = 1\n', "{p}: invalid TOML: Invalid value (at line 3, column 5)"),
        ("[preflight]\ndeadline_s = 3\n", "{p}: child.argv: required key is missing"),
        (
            MINIMAL + "[preflight]\ndedline_s = 3\n",
            "{p}: preflight.dedline_s: unknown key (did you mean 'deadline_s'?)",
        ),
        (MINIMAL + "[helth]\n", "{p}: helth: unknown key (did you mean 'health'?)"),
        (
            MINIMAL + "[preflight.reap]\nzzz = 1\n",
            "{p}: preflight.reap.zzz: unknown key (known keys: cmdline, companions, enabled, grace_s, names, "
            "protected_names, users)",
        ),
        (
            MINIMAL + "[preflight.reap]\nusers = []\n",
            "{p}: preflight.reap.users: expected at least one user name (an empty list would mean nobody, "
            "not everyone)",
        ),
        (
            MINIMAL + '[preflight]\ndeadline_s = "30"\n',
            "{p}: preflight.deadline_s: expected a number of seconds, got string '30'",
        ),
        (
            MINIMAL + "[preflight]\nmemory_threshold_mib = 1.5\n",
            "{p}: preflight.memory_threshold_mib: expected an integer, got number 1.5",
        ),
        (
            MINIMAL + "[preflight.reap]\nenabled = 1\n",
            "{p}: preflight.reap.enabled: expected true or false, got integer 1",
        ),
        (
            '[child]\nargv = "vllm serve /m"\n',
            "{p}: child.argv: expected an array of strings, got string 'vllm serve /m'",
        ),
        ("[child]\nargv = []\n", "{p}: child.argv: expected a non-empty array of strings, got an empty array"),
        ('[child]\nargv = ["vllm"]\nenv = { A = 1 }\n', "{p}: child.env.A: expected a string, got integer 1"),
        (
            MINIMAL + "[health]\nfailures_tolerated = 0\n",
            "{p}: health.failures_tolerated: expected an integer between 1 and 1000, got 0",
        ),
        (MINIMAL + "[shutdown]\ngrace_s = -1\n", "{p}: shutdown.grace_s: expected a value >= 0.01 and <= 3600, got -1"),
        # Lower bounds: 1e-300 s would make the poll loops spin a core.
        (
            MINIMAL + "[health]\ninterval_s = 1e-300\n",
            "{p}: health.interval_s: expected a value >= 0.01 and <= 3600, got 1e-300",
        ),
        (
            MINIMAL + "[preflight]\npoll_interval_s = 0.001\n",
            "{p}: preflight.poll_interval_s: expected a value >= 0.01 and <= 60, got 0.001",
        ),
        (
            MINIMAL + "[shutdown]\ngpu_release_timeout_s = 1e-300\n",
            "{p}: shutdown.gpu_release_timeout_s: expected 0 or a value >= 0.01 and <= 3600, got 1e-300",
        ),
        # Values that used to pass validation and fail only at spawn, after the preflight had acted.
        (
            '[child]\nargv = ["vllm", "a\\u0000b"]\n',
            "{p}: child.argv[1]: contains a NUL byte: 'a\\x00b'",
        ),
        (
            '[child]\nargv = ["vllm"]\nenv = { "A=B" = "1" }\n',
            "{p}: child.env: invalid variable name 'A=B': it must be non-empty, without '=' or NUL",
        ),
        (
            '[child]\nargv = ["vllm"]\nenv = { "" = "1" }\n',
            "{p}: child.env: invalid variable name '': it must be non-empty, without '=' or NUL",
        ),
        (
            '[child]\nargv = ["vllm"]\nenv = { "A\\u0000" = "1" }\n',
            "{p}: child.env: invalid variable name 'A\\x00': it must be non-empty, without '=' or NUL",
        ),
        ('[child]\nargv = ["vllm"]\nenv = { A = "x\\u0000" }\n', "{p}: child.env.A: contains a NUL byte"),
        (
            '[child]\nargv = ["vllm"]\nuser = "a b"\n',
            "{p}: child.user: expected a user name or numeric id, got 'a b'",
        ),
        (
            '[child]\nargv = ["vllm"]\ngroup = "video"\n',
            "{p}: child.group: is set without child.user: the child would keep root's user with another group",
        ),
        # A key with a newline cannot fake a second line of output.
        (
            MINIMAL + '"a\\nb" = 1\n',
            "{p}: child.'a\\nb': unknown key (known keys: argv, credentials, env, group, inherit_environment, user, "
            "working_directory)",
        ),
        (MINIMAL + "[preflight]\ngpus = [0, 0]\n", "{p}: preflight.gpus: expected distinct GPU indices, got [0, 0]"),
        (
            MINIMAL + '[preflight]\ngpus = "some"\n',
            "{p}: preflight.gpus: expected \"all\" or an array of GPU indices (e.g. [0, 1]), got string 'some'",
        ),
        (
            MINIMAL + '[readiness]\nfatal_patterns = ["x.py: (("]\n',
            "{p}: readiness.fatal_patterns[0]: invalid regular expression 'x.py: ((': missing ), unterminated "
            "subpattern at position 1",
        ),
        (
            MINIMAL + '[readiness]\nfatal_patterns = ["core.py: EngineCore failed", "died unexpectedly"]\n',
            "{p}: readiness.fatal_patterns[1]: 'died unexpectedly' names no source: write 'file.py: message start' "
            "(the file in vLLM's [file.py:line] header, e.g. 'multiproc_executor.py: Worker proc \\S+ died "
            "unexpectedly'); a bare pattern would match client text that vLLM logs",
        ),
        (
            MINIMAL + '[readiness]\nhealth_url = "localhost:8000"\n',
            "{p}: readiness.health_url: expected an http://, https:// or http+unix:// URL, got 'localhost:8000'",
        ),
        (
            '[child]\nargv = ["vllm", "serve", "/m", "--port", "abc"]\n',
            "{p}: child.argv: --port expects an integer, got 'abc'",
        ),
        (
            '[child]\nargv = ["vllm", "serve", "/m", "--gpu-memory-utilization", "1.5"]\n',
            "{p}: child.argv: --gpu-memory-utilization expects a fraction in (0, 1], got 1.5",
        ),
        (
            MINIMAL + '[preflight.shm]\nglobs = ["*"]\n',
            "{p}: preflight.shm.globs: expected file-name globs with a fixed part and no '/', got '*'",
        ),
        (MINIMAL + "[child]\n", "{p}: invalid TOML: Cannot declare ('child',) twice (at line 3, column 7)"),
    ],
)
def test_error_messages(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == expected.format(p=path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    assert error_of(path) == f"{path}: config file not found (use --config PATH)"


def test_directory(tmp_path: Path) -> None:
    assert error_of(tmp_path) == f"{tmp_path}: is a directory, expected a TOML file"


def test_unreadable_file() -> None:
    # Root reads mode-0 files, so use a file every reader gets an I/O error from.
    path = Path("/proc/self/mem")
    expected = rf"{path}: cannot read config \(resolves to /proc/\d+/mem\): Input/output error"
    assert re.fullmatch(expected, error_of(path))


def test_not_utf8(tmp_path: Path) -> None:
    path = write(tmp_path, b"[child]\nargv = ['\xff']\n")
    assert error_of(path) == f"{path}: not valid UTF-8 at byte 17"


def test_defaults_from_minimal(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.child.argv == ("vllm", "serve", "/m")
    assert cfg.child.vllm.model == "/m"
    assert cfg.readiness.health_url == "http://127.0.0.1:8000/health"
    assert cfg.preflight.gpus is None
    assert cfg.preflight.memory_threshold_mib == 1000
    assert cfg.preflight.shm.globs == ("psm_*", "sem.mp-*", "nccl-*")
    assert cfg.health.failures_tolerated == 3
    assert cfg.shutdown.grace_s == 30.0


def test_an_engine_on_a_unix_socket_is_probed_there(tmp_path: Path) -> None:
    """`--uds PATH` (an engine behind its front, docs/front.md): /health, /metrics and the canary go to the socket."""
    argv = '[child]\nargv = ["vllm", "serve", "/m", "--uds", "/run/k/NAME/front/engine.sock"]\n'
    cfg = load_config(write(tmp_path, argv))
    assert cfg.readiness.health_url == "http+unix://%2Frun%2Fk%2FNAME%2Ffront%2Fengine.sock/health"
    assert cfg.liveness.metrics_url == "http+unix://%2Frun%2Fk%2FNAME%2Ffront%2Fengine.sock/metrics"
    relative = '[child]\nargv = ["vllm", "serve", "/m", "--uds", "engine.sock"]\n'
    path = write(tmp_path, relative, "r.toml")
    assert error_of(path) == f"{path}: child.argv: --uds expects an absolute path, got 'engine.sock'"


def test_frozen(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(AttributeError):
        cfg.health = None  # type: ignore[misc]


def test_shipped_config_reproduces_the_seeds() -> None:
    cfg = load_config(REPO / "etc" / "kimi-supervisor.toml")
    argv = cfg.child.argv
    assert cfg.child.vllm.model == "/shared/kimi-k2.5-nvfp4"
    assert cfg.child.vllm.tensor_parallel_size == 8
    assert cfg.child.vllm.gpu_memory_utilization == 0.95
    assert argv[argv.index("--max-model-len") + 1] == "131072"
    assert "--tool-call-parser" in argv and "--reasoning-parser" in argv
    pinned = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_RAS_ADDR": "127.0.0.1:28100"}  # gpus = "all"
    assert dict(cfg.child.env) == {"NCCL_PROTO": "LL", "NCCL_P2P_LEVEL": "SYS"} | pinned
    assert cfg.preflight.memory_threshold_mib == 1000
    assert cfg.preflight.deadline_s == 30
    assert cfg.readiness.health_url == "http://127.0.0.1:8000/health"


def test_demo_profile_parses_and_runs_until_stopped() -> None:
    """The README's demo runs until Ctrl-C (was: the fake's 300 s safety net ended it, exit 13 "vLLM exited after
    ready without being asked to")."""
    from testkit.fakes.fake_vllm_options import parse_config as fake_options

    cfg = load_config(REPO / "etc" / "kimi-supervisor.demo.toml")
    assert cfg.preflight.gpus == ()
    assert cfg.child.argv[1] == "testkit/fakes/fake_vllm.py"
    assert fake_options(cfg.child.argv[2:]).max_lifetime == 0  # 0: never


def test_explicit_health_url_and_gpu_list(tmp_path: Path) -> None:
    cfg = parse_config(
        {"child": {"argv": ["vllm", "serve", "m", "--host", "::", "--port", "9000"]}, "preflight": {"gpus": [0, 3]}},
        tmp_path / "x.toml",
    )
    assert cfg.readiness.health_url == "http://[::1]:9000/health"
    assert cfg.preflight.gpus == (0, 3)


def test_cli_exit_code_and_single_line(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "[preflight]\nbogus = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 78
    assert proc.stdout == ""
    assert proc.stderr == (
        f"kimi-supervisor: config error: {path}: preflight.bogus: unknown key "
        "(known keys: busy_log_interval_s, check_model, check_port, deadline_s, gpus, "
        "memory_threshold_mib, poll_interval_s, reap, shm)\n"
    )


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (
            '"--shutdown-timeout", "1.5"',
            "{p}: child.argv: --shutdown-timeout expects an integer number of seconds, got '1.5'",
        ),
        ('"--shutdown-timeout=-5"', "{p}: child.argv: --shutdown-timeout expects >= 0 seconds, got -5"),
        ('"--shutdown-timeout"', "{p}: child.argv: option --shutdown-timeout has no value"),
    ],
)
def test_shutdown_timeout_errors(tmp_path: Path, flag: str, expected: str) -> None:
    path = write(tmp_path, f'[child]\nargv = ["vllm", "serve", "/m", {flag}]\n')
    assert error_of(path) == expected.format(p=path)


def test_shutdown_timeout_is_part_of_the_effective_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[child]\nargv = ["vllm", "serve", "/m", "--shutdown-timeout=120"]\n'))
    assert cfg.child.vllm.shutdown_timeout == 120
    assert effective_config(cfg)["child"]["vllm"]["shutdown_timeout"] == 120


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('"metrics.prom"', "{p}: metrics.textfile: expected an absolute path ending in .prom "
         "(node_exporter reads only *.prom), got 'metrics.prom'"),
        ('"/var/lib/node_exporter/kimi.txt"', "{p}: metrics.textfile: expected an absolute path ending in .prom "
         "(node_exporter reads only *.prom), got '/var/lib/node_exporter/kimi.txt'"),
        ("1", "{p}: metrics.textfile: expected a string, got integer 1"),
    ],
)  # fmt: skip
def test_metrics_textfile_is_checked(tmp_path: Path, value: str, expected: str) -> None:
    path = write(tmp_path, MINIMAL + f"[metrics]\ntextfile = {value}\n")
    assert error_of(path) == expected.format(p=path)


def test_metrics_off_unless_set(tmp_path: Path) -> None:
    assert parse_config({"child": {"argv": ["vllm"]}}, tmp_path / "k.toml").metrics.textfile is None
    cfg = parse_config({"child": {"argv": ["vllm"]}, "metrics": {"textfile": "/t/k.prom"}}, tmp_path / "k.toml")
    assert cfg.metrics.textfile == Path("/t/k.prom")
