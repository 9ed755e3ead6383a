"""structlog, imported without rich: a start pays for no pretty-traceback library it never uses.

structlog's package imports `structlog.dev` and `structlog.tracebacks`, which import rich (and through it
pygments) whenever it is installed, as it is in vLLM's virtualenv: ~40 ms of the supervisor's start before
the spawn on this CPU (bench/bench_lifecycle.py, row 11).  The supervisor renders exceptions itself
(`format_exc_info` for the journal and JSON, structlog's `plain_traceback` on a console), so rich is hidden
while structlog is imported, and only then: a process that imported rich already keeps it.
"""

from __future__ import annotations

import sys

_hidden = "rich" not in sys.modules
if _hidden:
    sys.modules["rich"] = None  # type: ignore[assignment]  # None in sys.modules: `import rich` raises ImportError
try:
    import structlog
finally:
    if _hidden:
        del sys.modules["rich"]

__all__ = ["structlog"]
