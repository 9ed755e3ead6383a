"""install-unit writes the command that is running, quoted as systemd reads it; failures have their own codes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.cli.entry import main as cli_main  # imported before a test drops to nobody (/root is closed)
from kimi_supervisor.exitcodes import ServiceUnavailable
from kimi_supervisor.systemd import unit
from testkit.harness import REPO
from tests.systemd.test_unit import directives

ROOT = os.geteuid() == 0
MINIMAL = '[child]\nargv = ["vllm", "serve", "/m"]\n'
has_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def console_script(path: Path) -> Path:
    """What pip writes into a venv's bin/ for our entry point."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from kimi_supervisor.cli.entry import main\nsys.exit(main())\n"
    )
    path.chmod(0o755)
    return path


def verify(unit_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True, timeout=60)


def test_exec_start_is_the_running_script_not_the_one_on_path(tmp_path: Path) -> None:
    # Before: shutil.which("kimi-supervisor"): under sudo (no venv on PATH) exit 70, with another install first
    # on PATH the wrong one, silently.
    ours = console_script(tmp_path / "my venv" / "bin" / "kimi-supervisor")
    decoy = console_script(tmp_path / "other" / "kimi-supervisor")
    config = tmp_path / "conf dir" / "k.toml"
    config.parent.mkdir()
    config.write_text(MINIMAL)
    units = tmp_path / "units"
    result = subprocess.run(
        [str(ours), "install-unit", "--config", str(config), "--unit-dir", str(units), "--no-reload"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{decoy.parent}:/usr/bin:/bin"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    text = (units / unit.UNIT_NAME).read_text()
    assert directives(text)["ExecStart"] == f'"{ours}" --config "{config}"'
    if shutil.which("systemd-analyze"):
        check = verify(units / unit.UNIT_NAME)
        assert check.returncode == 0 and check.stderr.strip() == "", check.stderr


def test_python_dash_m_writes_this_interpreter(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text(MINIMAL)
    argv = [sys.executable, "-m", "kimi_supervisor", "install-unit", "--config", str(config)]
    result = subprocess.run(
        [*argv, "--unit-dir", str(tmp_path), "--no-reload"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    exec_start = directives((tmp_path / unit.UNIT_NAME).read_text())["ExecStart"]
    assert exec_start == f"{sys.executable} -m kimi_supervisor --config {config}"


def test_running_executable_rules(tmp_path: Path) -> None:
    script = console_script(tmp_path / "bin" / "kimi-supervisor")
    link = tmp_path / "kimi-supervisor"
    link.symlink_to(script)
    assert unit.running_executable(str(link), "/venv/bin/python3") == [str(script)]
    main_py = str(REPO / "kimi_supervisor" / "__main__.py")
    assert unit.running_executable(main_py, "/venv/bin/python3") == ["/venv/bin/python3", "-m", "kimi_supervisor"]


@has_analyze
def test_quoting_is_read_back_by_systemd_as_the_same_path(tmp_path: Path) -> None:
    # systemd-analyze verify checks that ExecStart's program exists and is executable: it finds this file only
    # if it unquoted the word exactly as we meant (space, %, $).
    weird = tmp_path / "my tools 100% $HOME" / "kimi-supervisor"
    console_script(weird)
    target = tmp_path / unit.UNIT_NAME
    target.write_text(unit.render([str(weird)], tmp_path / "k 50% $X 'q' \"d\" back\\slash.toml"))
    check = verify(target)
    assert check.returncode == 0 and check.stderr.strip() == "", check.stderr
    assert '--config "' + str(tmp_path) + '/k 50%% $$X \'q\' \\"d\\" back\\\\slash.toml"' in target.read_text()
    # And the check is real: a path it does not find is reported.
    target.write_text(unit.render([str(weird).replace("100%", "100")], tmp_path / "k.toml"))
    assert "is not executable" in verify(target).stderr


def test_executable_path_systemd_refuses_is_one_line_not_a_crash() -> None:
    with pytest.raises(ServiceUnavailable, match="quotes, backslashes or control characters"):
        unit.render(['/opt/it"s/kimi-supervisor'])


def test_daemon_reload_failure_is_its_own_exit_code(tmp_path: Path) -> None:
    # Before: SupervisorError -> exit 70 ("a bug"). This host has no systemd as PID 1, so the reload fails.
    config = tmp_path / "k.toml"
    config.write_text(MINIMAL)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    systemctl = fake_bin / "systemctl"
    systemctl.write_text("#!/bin/sh\necho 'Failed to connect to bus: Host is down' >&2\nexit 1\n")
    systemctl.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "install-unit", "--config", str(config), "--unit-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PATH": f"{fake_bin}:/usr/bin:/bin"},
        timeout=60,
    )
    assert result.returncode == 69
    assert "systemctl daemon-reload failed: Failed to connect to bus: Host is down" in result.stderr
    assert "Traceback" not in result.stderr and (tmp_path / unit.UNIT_NAME).exists()


@pytest.mark.skipif(not ROOT, reason="drops to nobody")
def test_permission_denied_is_exit_77_in_one_line(open_dir: Path) -> None:
    # Before: exit 70. As nobody (what a forgotten sudo amounts to), /etc/systemd/system-like dirs are read-only.
    config = open_dir / "k.toml"
    config.write_text(MINIMAL)
    config.chmod(0o644)
    units = open_dir / "units"
    units.mkdir(mode=0o755)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        rc = 99
        try:
            sys.stderr = os.fdopen(write_fd, "w")  # not pytest's capture
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            rc = cli_main(["install-unit", "--config", str(config), "--unit-dir", str(units), "--no-reload"])
        finally:
            sys.stderr.flush()
            os._exit(rc)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        stderr = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 77, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert f"cannot write {units / unit.UNIT_NAME}: Permission denied (run it as root" in stderr


def install_unit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "install-unit", *args, "--no-reload"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_install_unit_instance_writes_the_template_and_the_instances_dropin(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    prom = tmp_path / "textfile" / "kimi-a.prom"
    (etc / "kimi-a.toml").write_text(MINIMAL + f'[shutdown]\ngrace_s = 100\n[metrics]\ntextfile = "{prom}"\n')
    units = tmp_path / "units"
    result = install_unit("--instance", "kimi-a", "--config", str(etc / "kimi-a.toml"), "--unit-dir", str(units))
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout
        == f"wrote {units / unit.TEMPLATE_NAME}; now: systemctl enable --now kimi-supervisor@kimi-a.service\n"
    )
    template = directives((units / unit.TEMPLATE_NAME).read_text())
    assert template["ExecStart"] == f"{sys.executable} -m kimi_supervisor --config {etc}/%i.toml"
    dropin = (units / "kimi-supervisor@kimi-a.service.d" / unit.DROPIN_NAME).read_text()
    # grace 100 + SIGKILL wait 5 + GPU release 30 + exit 10: this instance's own, not the template's 360.
    assert directives(dropin) == {
        "Description": "vLLM /m (TP=1) supervised by kimi-supervisor, deployment kimi-a",  # from its config
        "TimeoutStopSec": "145",
        "ReadWritePaths": f"-{prom.parent}",
    }
    assert not (units / unit.UNIT_NAME).exists()  # the plain unit is not touched
    if shutil.which("systemd-analyze"):
        (units / "kimi-supervisor@kimi-a.service").symlink_to(unit.TEMPLATE_NAME)
        check = verify(units / "kimi-supervisor@kimi-a.service")
        assert check.returncode == 0 and check.stderr.strip() == "", check.stderr


def test_install_unit_instance_refuses_a_config_of_another_name(tmp_path: Path) -> None:
    """The template runs NAME.toml and names NAME's directories after the instance: one name for all."""
    (tmp_path / "kimi-b.toml").write_text(MINIMAL)
    result = install_unit(
        "--instance", "kimi-a", "--config", str(tmp_path / "kimi-b.toml"), "--unit-dir", str(tmp_path)
    )
    assert result.returncode == 78
    assert result.stderr == (
        f"kimi-supervisor: config error: install-unit --instance kimi-a: kimi-supervisor@kimi-a runs "
        f"{tmp_path}/kimi-a.toml, not {tmp_path}/kimi-b.toml (name the config after the instance)\n"
    )
    (tmp_path / "kimi-a.toml").write_text(MINIMAL + '[deployment]\nname = "other"\n')
    result = install_unit(
        "--instance", "kimi-a", "--config", str(tmp_path / "kimi-a.toml"), "--unit-dir", str(tmp_path)
    )
    assert result.returncode == 78 and "deployment.name: 'other' is not the instance's name 'kimi-a'" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kimi-a.toml", "kimi-b.toml"]  # nothing written


def test_writable_paths_of_a_config(tmp_path: Path) -> None:
    from kimi_supervisor.config.load import parse_config

    plain = parse_config({"child": {"argv": ["vllm"]}}, tmp_path / "k.toml")
    assert unit.writable_paths(plain) == []  # the unit's own directories and homes already are
    moved = parse_config(
        {
            "child": {"argv": ["vllm"], "user": "nobody"},  # home /nonexistent: outside /root and /home
            "paths": {"runtime_directory": "/srv/k/run"},
            "metrics": {"textfile": "/var/lib/node_exporter/textfile_collector/k.prom"},
        },
        tmp_path / "k.toml",
    )
    assert unit.writable_paths(moved) == [
        Path("/nonexistent"),
        Path("/srv/k/run"),
        Path("/var/lib/node_exporter/textfile_collector"),
    ]


def test_install_unit_writes_the_holder_and_engine_pair(tmp_path: Path) -> None:
    """docs/weight-holder.md: an engine with `[weights] holder = true` gets its holder's unit beside it; the engine's
    drop-in binds it to the holder (BindsTo= + After=), the holder Wants= its engine."""
    etc = tmp_path / "etc"
    etc.mkdir()
    sockets = "/run/kimi-supervisor/kimi/weight-cache"
    extra = '{\\"socket_dir\\": \\"' + sockets + '\\", \\"fallback\\": false}'
    argv = f'["vllm", "serve", "/m", "--load-format", "ipc_cache", "--model-loader-extra-config", "{extra}"]'
    engine = f"[child]\nargv = {argv}\n"
    (etc / "kimi.toml").write_text(engine + "[weights]\nholder = true\n")
    units = tmp_path / "units"
    args = ("--instance", "kimi", "--config", str(etc / "kimi.toml"), "--unit-dir", str(units))
    result = install_unit(*args)
    assert result.returncode == 78  # no holder config yet: its load names the missing file
    assert "kimi.weights.toml" in result.stderr and not units.exists()
    holder = '[child]\nargv = ["vllm", "preload", "--model", "/m"]\n[deployment]\nname = "kimi"\nrole = "weights"\n'
    (etc / "kimi.weights.toml").write_text(holder + "[shutdown]\ngrace_s = 20\n")
    result = install_unit(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"wrote {units / unit.HOLDER_TEMPLATE_NAME} and {units / unit.TEMPLATE_NAME}; now: systemctl enable --now "
        "kimi-supervisor-weights@kimi.service kimi-supervisor@kimi.service\n"
    )
    template = directives((units / unit.HOLDER_TEMPLATE_NAME).read_text())
    assert template["ExecStart"] == f"{sys.executable} -m kimi_supervisor --config {etc}/%i.weights.toml"
    assert template["Wants"].endswith("kimi-supervisor@%i.service")
    assert template["SyslogIdentifier"] == "kimi-supervisor-weights@%i"
    engine_dropin = directives((units / "kimi-supervisor@kimi.service.d" / unit.DROPIN_NAME).read_text())
    assert engine_dropin["BindsTo"] == engine_dropin["After"] == "kimi-supervisor-weights@kimi.service"
    # Its restarts map the held weights (seconds): not the template's 15 s before each.
    assert template["RestartSec"] == "15" and engine_dropin["RestartSec"] == "2"
    holder_dropin = directives((units / "kimi-supervisor-weights@kimi.service.d" / unit.DROPIN_NAME).read_text())
    assert holder_dropin["TimeoutStopSec"] == "65"  # the holder's own grace 20 + 5 + 30 + 10
    if shutil.which("systemd-analyze"):
        (units / "kimi-supervisor@kimi.service").symlink_to(unit.TEMPLATE_NAME)
        (units / "kimi-supervisor-weights@kimi.service").symlink_to(unit.HOLDER_TEMPLATE_NAME)
        for name in ("kimi-supervisor@kimi.service", "kimi-supervisor-weights@kimi.service"):
            check = verify(units / name)
            assert check.returncode == 0 and check.stderr.strip() == "", check.stderr


def test_install_unit_refuses_a_holder_config_or_a_pair_without_instance(tmp_path: Path) -> None:
    holder = '[child]\nargv = ["vllm", "preload", "--model", "/m"]\n[deployment]\nname = "kimi"\nrole = "weights"\n'
    (tmp_path / "kimi.weights.toml").write_text(holder)
    result = install_unit("--config", str(tmp_path / "kimi.weights.toml"), "--unit-dir", str(tmp_path / "u"))
    assert result.returncode == 78 and "install-unit takes the engine's config" in result.stderr
    assert not (tmp_path / "u").exists()


FRONT_CONFIG = '[deployment]\nrole = "front"\n[front]\nport = 8000\n'  # no deployment.name: its file names it


def test_install_unit_of_an_engine_writes_its_fronts_unit_too_when_it_has_one(tmp_path: Path) -> None:
    """docs/front.md: one command for the deployment's units, as the holder's: the engine's config with NAME.front.toml
    beside it writes the front's template too; without one, nothing of a front (nothing the operator did not ask
    for); an engine the front could not reach (no --uds to its socket, no --enable-scale-out) is refused first."""
    etc, units = tmp_path / "etc", tmp_path / "units"
    etc.mkdir()
    (etc / "kimi-a.toml").write_text(MINIMAL)
    args = ("--instance", "kimi-a", "--config", str(etc / "kimi-a.toml"), "--unit-dir", str(units))
    assert install_unit(*args).returncode == 0
    assert sorted(p.name for p in units.iterdir()) == [unit.TEMPLATE_NAME, "kimi-supervisor@kimi-a.service.d"]
    (etc / "kimi-a.front.toml").write_text(FRONT_CONFIG)
    refused = install_unit(*args)
    sock = "/run/kimi-supervisor/kimi-a/front/engine.sock"
    assert (refused.returncode, refused.stderr) == (
        78,
        f"kimi-supervisor: config error: {etc}/kimi-a.toml: child.argv lacks --uds {sock} and --enable-scale-out (a "
        f"broken stream's resume needs /inference/v1/generate), which its front {etc}/kimi-a.front.toml needs\n",
    )
    assert not (units / unit.FRONT_TEMPLATE_NAME).exists()
    (etc / "kimi-a.toml").write_text(
        f'[child]\nargv = ["vllm", "serve", "/m", "--uds", "{sock}", "--enable-scale-out"]\n'
    )
    done = install_unit(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"wrote {units / unit.FRONT_TEMPLATE_NAME} and {units / unit.TEMPLATE_NAME}; now: systemctl enable --now "
        "kimi-supervisor@kimi-a.service kimi-supervisor-front@kimi-a.service\n"
    )
    front = directives((units / unit.FRONT_TEMPLATE_NAME).read_text())
    assert front["ExecStart"] == f"{sys.executable} -m kimi_supervisor --config {etc}/%i.front.toml"


def test_install_unit_of_a_front_honours_or_refuses_its_instance(tmp_path: Path) -> None:
    """--instance is never ignored: the front's own name is honoured, another one refused with nothing written."""
    (tmp_path / "kimi-a.front.toml").write_text(FRONT_CONFIG)
    config = ("--config", str(tmp_path / "kimi-a.front.toml"), "--unit-dir", str(tmp_path / "u"))
    refused = install_unit("--instance", "kimi-b", *config)
    assert (refused.returncode, refused.stderr) == (
        78,
        f"kimi-supervisor: config error: install-unit --instance kimi-b: {tmp_path}/kimi-a.front.toml is the front of "
        "deployment 'kimi-a' (kimi-supervisor-front@kimi-a): give --instance kimi-a, or the config of 'kimi-b'\n",
    )
    assert not (tmp_path / "u").exists()
    done = install_unit("--instance", "kimi-a", *config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("now: systemctl enable --now kimi-supervisor-front@kimi-a.service\n")


def test_a_second_instance_from_another_directory_is_refused_not_rewritten_under_the_first(tmp_path: Path) -> None:
    """The template runs `<its directory>/%i.toml` for every instance: rewritten for a config elsewhere, the first
    instance's next start would run a file that is not there (was: rewritten silently).  Refused, exit 78, nothing
    written; the same directory is no conflict."""
    first, other, units = tmp_path / "etc", tmp_path / "srv", tmp_path / "units"
    for directory, name in ((first, "kimi-a"), (other, "kimi-b"), (first, "kimi-c")):
        directory.mkdir(exist_ok=True)
        (directory / f"{name}.toml").write_text(MINIMAL)
    assert (
        install_unit(
            "--instance", "kimi-a", "--config", str(first / "kimi-a.toml"), "--unit-dir", str(units)
        ).returncode
        == 0
    )
    template = (units / unit.TEMPLATE_NAME).read_text()
    refused = install_unit("--instance", "kimi-b", "--config", str(other / "kimi-b.toml"), "--unit-dir", str(units))
    assert (refused.returncode, refused.stderr) == (
        78,
        f"kimi-supervisor: config error: {units / unit.TEMPLATE_NAME} runs its instances' configs from {first} "
        f"(kimi-supervisor@kimi-a.service), not {other}: put this config in {first}, or remove "
        f"{units / unit.TEMPLATE_NAME} first if no instance runs from {first}\n",
    )
    assert (units / unit.TEMPLATE_NAME).read_text() == template
    assert not (units / "kimi-supervisor@kimi-b.service.d").exists()
    assert (
        install_unit(
            "--instance", "kimi-c", "--config", str(first / "kimi-c.toml"), "--unit-dir", str(units)
        ).returncode
        == 0
    )


def test_the_units_description_is_its_configs_model_and_tp(tmp_path: Path) -> None:
    """Was "Kimi-K2.5 NVFP4 (TP=8)" whatever the config served: the served model name (else the model) and TP."""
    (tmp_path / "kimi-supervisor.toml").write_text(
        '[child]\nargv = ["vllm", "serve", "/models/qwen", "--served-model-name", "qwen-7b", "-tp", "2"]\n'
    )
    units = tmp_path / "units"
    done = install_unit("--config", str(tmp_path / "kimi-supervisor.toml"), "--unit-dir", str(units))
    assert done.returncode == 0, done.stderr
    assert directives((units / unit.UNIT_NAME).read_text())["Description"] == (
        "vLLM qwen-7b (TP=2) supervised by kimi-supervisor"
    )
    assert "Kimi" not in directives(unit.render(template=True))["Description"]  # the template serves every instance
