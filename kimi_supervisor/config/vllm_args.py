"""What the supervisor needs to know from the child's `vllm serve` argv.

Parsed, not guessed: the model directory, where /health lives, the tensor-
parallel size, the memory fraction vLLM will try to take and how long it
drains in-flight requests on SIGTERM (--shutdown-timeout).  The argv stays a
list (never a shell string), so this is a small option scanner.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

# vLLM's own defaults (vllm/engine/arg_utils.py; the memory fraction is CacheConfig's in vllm/config/cache.py,
# 0.92 in 0.32: tests/e2e/test_vllm_yaml_parser.py asks vLLM's parser).
DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8000
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# A URL of a server on a Unix socket: the socket's path, percent-encoded, as the host (liveness/http.py).
UNIX_SCHEME = "http+unix"

_VALUE_OPTIONS = {
    "--model": "model",
    "--host": "host",
    "--port": "port",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    # With TP, the sizes whose product is the GPUs one node's vLLM takes (vllm/engine/arg_utils.py).
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
    "--gpu-memory-utilization": "gpu_util",
    "--served-model-name": "served_name",  # takes one or more names; the first is what clients use
    # vLLM >= 0.32: on SIGTERM, reject new requests and let in-flight ones finish for up to this many
    # seconds (0, the default, aborts them at once).
    "--shutdown-timeout": "shutdown_timeout",
    # vLLM's API server on a Unix socket instead of host:port (entrypoints/launchers/launcher.py): an engine
    # behind its front (docs/front.md); the supervisor's own requests go there too (liveness/http.py).
    "--uds": "uds",
}


# vLLM: "Everything between the first -- and the first ." has its underscores made dashes.
_DOTTED = re.compile(r"(?<=--)[^.]*")


def option_name(word: str) -> str:
    """`--tensor_parallel_size=4` -> `--tensor-parallel-size=4`, as vLLM's parser rewrites every `--` word
    (vllm/utils/argparse_utils.py)."""
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return _DOTTED.sub(lambda m: m.group(0).replace("_", "-"), name) + eq + value


@dataclasses.dataclass(frozen=True)
class VllmArgs:
    model: str | None
    host: str
    port: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    served_name: str | None = None
    shutdown_timeout: int = 0
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    uds: str | None = None  # --uds PATH: the API is on this Unix socket, not on host:port
    config_file: str | None = None  # vLLM's own `--config FILE`, whose flags are in the values above

    @property
    def world_size(self) -> int:
        """The GPUs this vLLM takes on one node: TP x PP x DP (a GPU per rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def parallel_flags(self) -> str:
        """The size flags that make the world size, as an operator reads them: `--tensor-parallel-size 4 x
        --pipeline-parallel-size 2`; sizes of 1 other than TP's are left out."""
        sizes = [("--tensor-parallel-size", self.tensor_parallel_size)]
        sizes += [
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ]
        return " x ".join(f"{flag} {n}" for i, (flag, n) in enumerate(sizes) if i == 0 or n > 1)

    @property
    def served_model_name(self) -> str | None:
        """The name requests must give as "model": vLLM's first --served-model-name, else the model path."""
        return self.served_name or self.model

    @property
    def health_url(self) -> str:
        return self.api_url("/health")

    def api_url(self, path: str) -> str:
        if self.uds is not None:
            return f"{UNIX_SCHEME}://{urllib.parse.quote(self.uds, safe='')}{path}"
        # A wildcard bind answers on loopback; probe there, never elsewhere.
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}{path}"

    @property
    def drains(self) -> bool:
        return self.shutdown_timeout > 0


def _options(argv: list[str] | tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    found: dict[str, str] = {}
    positionals: list[str] = []
    i = 1
    while i < len(argv):
        arg = option_name(argv[i])
        name, eq, inline = arg.partition("=")
        if name in _VALUE_OPTIONS:
            if eq:
                found[_VALUE_OPTIONS[name]] = inline
            elif i + 1 < len(argv):
                found[_VALUE_OPTIONS[name]] = argv[i + 1]
                i += 1
            else:
                raise ValueError(f"option {name} has no value")
        elif not arg.startswith("-"):
            positionals.append(arg)
        i += 1
    return found, positionals


def parse_vllm_args(argv: list[str] | tuple[str, ...]) -> VllmArgs:
    """Extract model, host, port, TP/PP/DP sizes and memory fraction; ValueError names the bad option."""
    found, positionals = _options(argv)
    model = found.get("model")
    # `vllm serve MODEL ...`: the model right after "serve" wins over a --model (vLLM's model_tag, which its
    # --config file's `model` never overrides); else the positional after "serve".
    serve = argv.index("serve", 1) if "serve" in argv[1:] else None
    if serve is not None and serve + 1 < len(argv) and not argv[serve + 1].startswith("-"):
        model = argv[serve + 1]
    if model is None and "serve" in positionals:
        idx = positionals.index("serve")
        if idx + 1 < len(positionals):
            model = positionals[idx + 1]
    try:
        port = int(found.get("port", DEFAULT_PORT))
    except ValueError:
        raise ValueError(f"--port expects an integer, got {found['port']!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"--port expects 1..65535, got {port}")
    tp, pp, dp = (_size(found, key, flag) for key, flag in _SIZE_FLAGS)
    try:
        util = float(found.get("gpu_util", DEFAULT_GPU_MEMORY_UTILIZATION))
    except ValueError:
        raise ValueError(f"--gpu-memory-utilization expects a number, got {found['gpu_util']!r}") from None
    if not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization expects a fraction in (0, 1], got {util:g}")
    try:
        # vLLM's argparse type is int: "30.5" makes it exit 2 at start, so refuse it here.
        drain = int(found.get("shutdown_timeout", 0))
    except ValueError:
        raise ValueError(
            f"--shutdown-timeout expects an integer number of seconds, got {found['shutdown_timeout']!r}"
        ) from None
    if drain < 0:
        raise ValueError(f"--shutdown-timeout expects >= 0 seconds, got {drain}")
    host = found.get("host", DEFAULT_HOST)
    uds = found.get("uds")
    if uds is not None and not uds.startswith("/"):
        raise ValueError(f"--uds expects an absolute path, got {uds!r}")
    return VllmArgs(model, host, port, tp, util, found.get("served_name"), drain, pp, dp, uds)


_SIZE_FLAGS = (("tp", "--tensor-parallel-size"), ("pp", "--pipeline-parallel-size"), ("dp", "--data-parallel-size"))


def _size(found: dict[str, str], key: str, flag: str) -> int:
    try:
        size = int(found.get(key, 1))
    except ValueError:
        raise ValueError(f"{flag} expects an integer, got {found[key]!r}") from None
    if size < 1:
        raise ValueError(f"{flag} expects >= 1, got {size}")
    return size


def served_at(health_url: str) -> str:
    """Where the API serves, as an operator reads it (the headline, `status`): the URL without /health, and vLLM's
    --uds socket as its path, `unix:/run/.../engine.sock`, not the percent-encoded host the probes connect to."""
    base = health_url.rsplit("/health", 1)[0]
    parts = urllib.parse.urlsplit(base)
    return f"unix:{urllib.parse.unquote(parts.netloc)}" if parts.scheme == UNIX_SCHEME else base
