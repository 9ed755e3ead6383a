"""The alert rules with each runbook_url under the docs' own address (docs/operators-view.md, "Runbooks").

    python3 packaging/prometheus/render_rules.py --runbook-base https://docs.example.com/kimi/ > kimi.rules.yml

`--runbook-base` is where the docs tree is served, README.md at its root: each rule's runbook_url becomes
<base>docs/operators-view.md#<the alert's name in lower case>, an http(s) address a pager and Alertmanager open.
The committed kimi-supervisor.rules.yml names file:///opt/kimi-supervisor/share/doc/kimi-supervisor/ (the README's
venv install puts the docs there), which is right only on the host itself; without --runbook-base it is printed as
it is.  Nothing but the runbook_url lines changes (tests/opsview/test_alert_rules.py).
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.parse
from pathlib import Path

RULES = Path(__file__).resolve().with_name("kimi-supervisor.rules.yml")
INSTALLED = "file:///opt/kimi-supervisor/share/doc/kimi-supervisor/"
_RUNBOOK = re.compile(r'^(\s*runbook_url: ")' + re.escape(INSTALLED) + r'(docs/operators-view\.md#[a-z0-9-]+")$', re.M)


def render(base: str | None) -> str:
    text = RULES.read_text()
    if base is None:
        return text
    parts = urllib.parse.urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"--runbook-base: expected an http:// or https:// URL of the docs' root, got {base!r}")
    root = base if base.endswith("/") else base + "/"
    rendered, count = _RUNBOOK.subn(lambda m: m.group(1) + root + m.group(2), text)
    if count != len(re.findall(r"^\s*runbook_url:", text, re.M)):
        raise ValueError(f"{RULES}: a runbook_url not under {INSTALLED}")
    return rendered


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runbook-base", metavar="URL", help="where the docs are served (README.md at its root)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(args.runbook_base))
    except ValueError as exc:
        print(f"render_rules.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
