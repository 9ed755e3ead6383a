"""The dry-run report: one line per check and a verdict, readable in five seconds."""

from __future__ import annotations

import json
from collections.abc import Mapping

from kimi_supervisor.checks import Verdict
from kimi_supervisor.preflight.run import PreflightReport
from kimi_supervisor.quoting import escape_controls

_MARK = {
    Verdict.OK: "ok",
    Verdict.DONE: "done",
    Verdict.SKIP: "skip",
    Verdict.KEEP: "keep",
    Verdict.KILL: "would kill",
    Verdict.REMOVE: "would remove",
    Verdict.WAIT: "would wait",
    Verdict.WARN: "warn",
    Verdict.NA: "n/a",
    Verdict.FAIL: "FAILED",
}


def render_text(report: PreflightReport, config_path: str) -> str:
    width = max(len(m) for m in _MARK.values())
    # A file or process name may hold a newline: it must not fake a report line (e.g. a verdict).
    lines = [
        f"kimi-supervisor preflight ({'dry run: nothing was killed or removed' if report.dry_run else 'real'})",
        f"config: {escape_controls(config_path)}",
    ]
    for c in report.checks:
        lines.append(f"  [{_MARK[c.verdict]:>{width}}] {c.name:<19} {escape_controls(c.message)}")
    failures = report.failures()
    if report.proceed:
        lines.append("verdict: a start would proceed")
    else:
        lines.append(
            f"verdict: a start would NOT proceed ({len(failures)} blocking: "
            + ", ".join(sorted({c.name for c in failures}))
            + ")"
        )
    return "\n".join(lines)


def render_json(report: PreflightReport, config_path: str, child_env: Mapping[str, str] | None = None) -> str:
    data = report.to_dict()
    data["config"] = config_path
    if child_env is not None:  # what the supervisor sets over the inherited environment, secrets redacted
        data["child_env"] = dict(child_env)
    return json.dumps(data, indent=2, sort_keys=False)
