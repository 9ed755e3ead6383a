"""What the child's output says about its progress toward serving.

The tracker turns lines into: the current phase (only ever moving forward,
since vLLM's processes interleave), weight-loading progress, "the server says
it started", and fatal lines.  Ready needs that *and* GET /health == 200; the
second half lives in liveness/health_probe.py.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from kimi_supervisor.child.lines import ChildLine, Kind, LineClassifier
from kimi_supervisor.child.loadphases import PATTERNS as LOAD_PATTERNS
from kimi_supervisor.child.loadphases import LoadPhases
from kimi_supervisor.clock import format_duration
from kimi_supervisor.config.model import ReadinessConfig

# (phase, pattern) in the order vLLM goes through them; version-tolerant.
PHASES: tuple[tuple[str, str], ...] = (
    (
        "starting engine",
        r"vLLM API server version|Initializing a V1 LLM engine|Starting engine|Waiting for init message",
    ),
    (
        "loading weights",
        r"Starting to load model|Loading model from|Loading weights|Loading safetensors checkpoint shards",
    ),
    ("weights loaded", r"Model loading took|Loading weights took"),
    ("profiling KV cache", r"Memory profiling takes|Available KV cache memory|[GC]PU KV cache size|# GPU blocks"),
    # Not a bare "torch.compile": vLLM 0.32 warns "Enforce eager set, disabling torch.compile" at the start.
    (
        "compiling / capturing CUDA graphs",
        r"Capturing CUDA graph|torch\.compile took|Compiling a graph for|Graph capturing finished|Dynamo bytecode",
    ),
    (
        "starting API server",
        r"Starting vLLM (?:API )?server|Started server process|Waiting for application startup|Route: /",
    ),
)
LOADING_WEIGHTS = 1  # index of "loading weights" in PHASES
_PROGRESS = re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+)")
# How far before a fatal line its root cause may be (vLLM 0.32 prints ~120 lines of tracebacks after it).
CAUSE_WINDOW = 300
# vLLM's INFO/WARNING/DEBUG lines mention errors ("can cause fd limit errors like OSError"): never a cause.
_QUIET_LEVEL = re.compile(r"^(?:\([^)]*pid=\d+\)\s*)?(?:INFO|WARNING|DEBUG)\b")
# Lines that only point elsewhere ("See root cause above"): never the root cause.
_SUMMARY = re.compile(
    r"See root cause above|See stack trace|Engine core initialization failed|EngineCore failed to start"
    r"|EngineCore encountered a fatal error"
)
# Fatal records that only announce the traceback that follows them in the same record (logger.exception).
_ANNOUNCES = re.compile(r"failed to start\.|WorkerProc failed\.|output_handler failed\.")
# "XxxError: message" (not "raise XxxError(": source lines in a traceback are not the cause).
_ROOT_CAUSE = re.compile(r"\b(?:\w+Error|\w+Exception|OutOfMemory\w*): |\bCUDA error\b|\bNCCL error\b")


# Inside a vLLM record, a cause is the exception line of its traceback, at the message start; the rest of a
# record's message may be a client's words ("Error with model ... `FooError: x` does not exist").
_CAUSE_START = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|OutOfMemory\w*)\b: ")


def _might_be_cause(line: str) -> bool:
    # Cheap substring tests before the backtracking regex: most lines have none of these.
    return "rror" in line or "xception" in line or "OutOfMemory" in line


def _top_level_alternatives(pattern: str) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _required_word(alternative: str) -> str | None:
    """A run of >= 4 letters that every match of `alternative` must contain, if one is easy to see."""
    depth, i, word = 0, 0, ""
    while i < len(alternative):
        c = alternative[i]
        if c == "\\":
            if len(word) >= 4:
                return word
            word, i = "", i + 2
            continue
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        if depth == 0 and c.isalpha():
            word += c
            nxt = alternative[i + 1 : i + 2]
            if nxt and nxt in "?*{":
                word = word[:-1]  # the last letter is optional
                if len(word) >= 4:
                    return word
                word = ""
        else:
            if len(word) >= 4:
                return word
            word = ""
        i += 1
    return word if len(word) >= 4 else None


def literal_prefilter(patterns: list[str]) -> re.Pattern[str] | None:
    """A regex of literal words, one of which any match of any pattern contains; None when unsure."""
    words: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("(?"):
            return None  # inline flags (e.g. case-insensitive): no safe literal
        for alternative in _top_level_alternatives(pattern):
            word = _required_word(alternative)
            if word is None:
                return None
            words.add(word)
    return re.compile("|".join(re.escape(w) for w in sorted(words)))


def _record_key(line: ChildLine) -> tuple[str, str]:
    """Which process and logging call a line belongs to: every line of one vLLM record has the same."""
    return (line.fields.get("VLLM_PID", ""), line.source or "")


@dataclasses.dataclass(frozen=True)
class Progress:
    done: int
    total: int
    percent: int


@dataclasses.dataclass(frozen=True)
class LineEvent:
    phase_changed: bool = False
    progress_changed: bool = False
    started: bool = False
    fatal: bool = False


_NOTHING = LineEvent()


class ReadinessTracker:
    def __init__(self, cfg: ReadinessConfig, tail_lines: int = 40) -> None:
        self._started = cfg.started_patterns
        self._fatal = cfg.fatal_patterns
        self._fatal_sources = {rule.source for rule in self._fatal}
        self._phase_rx = [re.compile(p) for _, p in PHASES]
        # Most lines matter to no pattern: a search for literal words every pattern needs rejects them
        # in well under a microsecond; the combined pattern confirms the rest.
        every = [p for _, p in PHASES] + [_PROGRESS.pattern] + [r.pattern for r in self._started] + list(LOAD_PATTERNS)
        self._any = re.compile("|".join(f"(?:{p})" for p in every))
        self._prefilter = literal_prefilter(every)
        self.phase_index = -1
        self.progress: Progress | None = None
        self.load = LoadPhases()  # what each phase took, from vLLM's own lines (loadphases.py)
        self.server_started = False
        self.fatal_line: str | None = None
        self.fatal_rule: str | None = None  # the rule (`file.py: message`) that matched fatal_line
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        # (line number, line) of recent exception-looking lines at error level.
        self._causes: collections.deque[tuple[int, str]] = collections.deque(maxlen=32)
        # The fatal record's own exception (its logger.exception traceback ends after the record's first line).
        self._fatal_key: tuple[str, str] | None = None
        self._fatal_cause: str | None = None
        self._line_no = 0
        self._fatal_no = 0
        # Set at READY: from then on only fatal lines matter.
        self.serving = False
        self._classifier = LineClassifier()

    @property
    def prefilter(self) -> re.Pattern[str] | None:
        """Literal words one of which every line that can move the phase, progress or "started" contains;
        None when unsure (output.py's bulk path then looks at every line while starting)."""
        return self._prefilter

    def skip(self, count: int) -> None:
        """`count` lines that feed would have ignored (no fatal, phase, progress or started pattern can see them:
        output.py proves it for a whole block at once): the line count moves; output.py appends the block's
        last lines to `tail` itself, once per wake-up rather than once per read."""
        self._line_no += count

    @property
    def phase(self) -> str:
        if self.server_started:
            return "API server up, waiting for /health"
        return PHASES[self.phase_index][0] if self.phase_index >= 0 else "spawning"

    def feed(self, line: ChildLine | str) -> LineEvent:
        """What `line` changes.  Which patterns may see it depends on what kind of line it is (childlog.Kind):
        a fatal rule only an ERROR+ record logged by the rule's file, from the start of its message (vLLM
        logs client text at ERROR too: "Error with model ... `EngineDeadError` does not exist"); root causes
        only ERROR+ records and tracebacks; "started" only the server's own records; phases and progress its
        records and progress bars.  A request line (uvicorn's access log), a traceback, any INFO/DEBUG record
        never fail the run, and nothing after READY moves the phase: no client text changes the
        supervisor's state.
        """
        if isinstance(line, str):
            line = self._classifier.classify_line(line)  # one stream (the tests, the fixtures)
        text = line.text
        self.tail.append(text)
        self._line_no += 1
        if not line.may_be_fatal and not (line.may_show_progress and not self.serving):
            return _NOTHING
        if (
            line.may_be_fatal
            and _might_be_cause(text)
            and not _QUIET_LEVEL.match(text)
            and _ROOT_CAUSE.search(text)
            and not _SUMMARY.search(text)
            and (line.source is None or _CAUSE_START.match(line.message))
        ):
            self._causes.append((self._line_no, text.strip()))
            if self._fatal_cause is None and self._fatal_key is not None and self._fatal_key == _record_key(line):
                self._fatal_cause = text.strip()
        if line.kind is Kind.RECORD and line.priority <= 3 and line.source is not None:
            source = line.source.rsplit("/", 1)[-1]
            if source in self._fatal_sources:
                rule = next((r for r in self._fatal if r.matches(source, line.message)), None)
                if rule is not None:
                    if self.fatal_line is None:
                        self.fatal_line, self.fatal_rule = text.strip(), rule.text
                        self._fatal_no = self._line_no
                        if _SUMMARY.search(text) or _ANNOUNCES.search(text):
                            self._fatal_key = _record_key(line)  # its cause is its own traceback, to come
                    return LineEvent(fatal=True)
        if self._prefilter is not None and not self._prefilter.search(text):
            return _NOTHING
        if not self._any.search(text):
            return _NOTHING
        if self.serving or not line.may_show_progress:
            return _NOTHING
        if line.kind is Kind.RECORD and line.source is not None:
            self.load.feed(line.source.rsplit("/", 1)[-1], line.message)
        progress_changed = False
        m = _PROGRESS.search(text)
        if m:
            new = Progress(int(m.group(2)), int(m.group(3)), int(m.group(1)))
            progress_changed = new != self.progress
            self.progress = new
        phase_changed = False
        for index in range(len(PHASES) - 1, self.phase_index, -1):
            if self._phase_rx[index].search(text):
                self.phase_index = index
                phase_changed = True
                break
        started = False
        if line.may_start and not self.server_started and any(rx.search(text) for rx in self._started):
            self.server_started = started = phase_changed = True
        return LineEvent(phase_changed, progress_changed, started)

    @property
    def weights_loaded(self) -> bool:
        return self.phase_index > LOADING_WEIGHTS

    def headline(self, elapsed_s: float, eta: str | None = None, read_rate: str | None = None) -> str:
        """`loading weights 68/119 (57%), 4m12s, 1.02 GB/s, ~3m10s left` (the storage read rate while loading
        weights and the ETA only when known)."""
        text = self.phase
        loading = self.phase == "loading weights"
        if self.progress is not None and loading:
            p = self.progress
            text += f" {p.done}/{p.total} ({p.percent}%)"
        text += f", {format_duration(elapsed_s)}"
        if read_rate and loading:
            text += f", {read_rate}"
        return text + (f", {eta}" if eta else "")

    def root_cause(self) -> str:
        """The line that explains a failure best.

        A fatal line that says what happened ("Worker proc ... died unexpectedly") is its own root cause;
        one that only announces a traceback ("WorkerProc failed to start.") yields to that traceback's
        exception (the same process's record, after it: "torch.OutOfMemoryError: CUDA out of memory ..."),
        else to the last error-level exception line shortly before it; without a fatal line, the last such
        exception line.
        """
        if self._fatal_cause is not None:
            return self._fatal_cause
        if (
            self.fatal_line is not None
            and not _SUMMARY.search(self.fatal_line)
            and not _ANNOUNCES.search(self.fatal_line)
        ):
            return self.fatal_line
        last = self._fatal_no if self.fatal_line is not None else self._line_no
        near = [text for n, text in self._causes if last - CAUSE_WINDOW <= n <= last]
        if near:
            return near[-1]
        return self.fatal_line or (self.tail[-1].strip() if self.tail else "(no output)")
