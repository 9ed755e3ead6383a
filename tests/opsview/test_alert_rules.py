"""The alerts an operator pastes (packaging/prometheus/kimi-supervisor.rules.yml): valid rules, and each one
proven by `promtool test rules` (alert_rules.test.yml) to fire when its cause is there and not otherwise."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kimi_supervisor.opsview.textfile import MetricsSnapshot, render
from tests.promtool import promtool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "packaging" / "prometheus" / "kimi-supervisor.rules.yml"
TESTS = Path(__file__).with_name("alert_rules.test.yml")


def alerts() -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\S+)\s*$", RULES.read_text(), re.M)


def test_rules_are_valid() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_every_rule_has_a_firing_and_a_quiet_case() -> None:
    text = TESTS.read_text()
    assert sorted(alerts()) == sorted(
        {
            "KimiSupervisorNotServing",
            "KimiSupervisorRestartingRepeatedly",
            "KimiSupervisorGpuFailed",
            "KimiSupervisorEngineWedged",
            "KimiSupervisorPreflightKilledProcesses",
            "KimiSupervisorStartRefused",
            "KimiSupervisorTextfileStale",
            "KimiSupervisorUnitFailed",
            "KimiFrontRequestsFailedByRestart",
            "KimiFrontNoReadySpare",
        }
    )
    for name in alerts():
        cases = re.findall(rf"alertname: {name}\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n\n|\Z)", text, re.S)
        assert any(c.strip() == "[]" for c in cases), f"{name}: no evaluation where it must stay quiet"
        assert any("exp_labels" in c for c in cases), f"{name}: no evaluation where it must fire"


def test_promtool_test_rules_passes() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", TESTS.name], cwd=TESTS.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_use_only_metrics_the_textfile_writes() -> None:
    """A renamed metric would leave an alert that never fires: every name in the rules is one we write."""
    full = MetricsSnapshot(
        state="ready",
        last_load_s=1.0,
        last_failure=(18, "x"),
        started_timestamp_s=1.0,
        last_failure_timestamp_s=1.0,
        health_latency_s=0.1,
    )
    written = set(re.findall(r"^(kimi_supervisor_\w+)[{ ]", render(full, "a", "engine", "a.prom").decode(), re.M))
    used = set(re.findall(r"\b(kimi_supervisor_[a-z_]+)\b", RULES.read_text()))
    assert used and used <= written, used - written


def test_the_front_rules_use_only_metrics_the_front_serves() -> None:
    """Its rule reads /front/metrics (deployment/front/metrics.py): a renamed metric would never fire."""
    from kimi_supervisor.deployment.front.metrics import FrontMetrics

    metrics = FrontMetrics("a")
    metrics.finished("failed_restart")
    served = metrics.text().decode()
    assert 'kimi_front_restart_failures_total{deployment="a"} 1.0' in served
    written = set(re.findall(r"^(kimi_front_\w+)[{ ]", served, re.M))
    used = set(re.findall(r"\b(kimi_front_[a-z_]+)\b", RULES.read_text()))
    assert used and used <= written, used - written


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the file's headings (GitHub's rule: lower case, punctuation
    but `-` and `_` dropped, spaces as `-`); fenced code is not a heading."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return anchors


def test_every_rule_has_a_runbook_url_whose_section_exists() -> None:
    """An alert people can act on: its runbook_url is a section of docs/operators-view.md that is there."""
    doc = REPO / "docs" / "operators-view.md"
    anchors = heading_anchors(doc.read_text())
    urls = dict(
        re.findall(
            r"^\s*- alert:\s*(\S+)\s*$(?:(?!^\s*- alert:).)*?^\s*runbook_url:\s*\"([^\"]+)\"",
            RULES.read_text(),
            re.M | re.S,
        )
    )
    assert sorted(urls) == sorted(alerts()), "a rule without runbook_url"
    for name, url in urls.items():
        path, _, anchor = url.partition("#")
        assert path == "file:///opt/kimi-supervisor/share/doc/kimi-supervisor/docs/operators-view.md", url
        assert anchor == name.lower() and anchor in anchors, f"{name}: no section #{anchor} in {doc.name}"
    # The check can fail: a heading that is not there is not found.
    assert "kimisupervisornosuchalert" not in anchors and "runbooks" in anchors


def test_the_runbook_base_is_a_setting_of_the_rules_generator() -> None:
    """A file:// runbook_url opens in no pager and no Alertmanager: render_rules.py writes the rules with the docs'
    http(s) address instead, each runbook_url <base>docs/operators-view.md#<alert>, the rules otherwise the same;
    a base that is no http(s) URL is refused (exit 2)."""
    import subprocess
    import sys

    import yaml

    script = REPO / "packaging" / "prometheus" / "render_rules.py"
    base = "https://docs.example.com/kimi-supervisor"  # without the closing slash: added

    def render(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)

    done = render("--runbook-base", base)
    assert done.returncode == 0, done.stderr
    rendered, committed = yaml.safe_load(done.stdout), yaml.safe_load(RULES.read_text())
    rules = [rule for group in rendered["groups"] for rule in group["rules"]]
    assert [r["annotations"]["runbook_url"] for r in rules] == [
        f"{base}/docs/operators-view.md#{r['alert'].lower()}" for r in rules
    ]
    for group in (rendered, committed):
        for rule in (r for g in group["groups"] for r in g["rules"]):
            rule["annotations"].pop("runbook_url")
    assert rendered == committed
    assert render().stdout == RULES.read_text()
    refused = render("--runbook-base", "file:///srv/docs/")
    assert refused.returncode == 2 and "expected an http:// or https:// URL" in refused.stderr
