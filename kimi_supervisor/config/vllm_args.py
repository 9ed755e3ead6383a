"""What the supervisor needs to know from the child's `vllm serve` argv.

Parsed, not guessed: the model directory, where /health lives, the tensor-
parallel size, the memory fraction vLLM will try to take and how long it
drains in-flight requests on SIGTERM (--shutdown-timeout).  The argv stays a
list (never a shell string), so this is a small option scanner.
"""

from __future__ import annotations

import dataclasses

# vLLM's own defaults (vllm/engine/arg_utils.py).
DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8000
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_VALUE_OPTIONS = {
    "--model": "model",
    "--host": "host",
    "--port": "port",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--gpu-memory-utilization": "gpu_util",
    "--served-model-name": "served_name",  # takes one or more names; the first is what clients use
    # vLLM >= 0.32: on SIGTERM, reject new requests and let in-flight ones finish for up to this many
    # seconds (0, the default, aborts them at once).
    "--shutdown-timeout": "shutdown_timeout",
}


@dataclasses.dataclass(frozen=True)
class VllmArgs:
    model: str | None
    host: str
    port: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    served_name: str | None = None
    shutdown_timeout: int = 0

    @property
    def served_model_name(self) -> str | None:
        """The name requests must give as "model": vLLM's first --served-model-name, else the model path."""
        return self.served_name or self.model

    @property
    def health_url(self) -> str:
        return self.api_url("/health")

    def api_url(self, path: str) -> str:
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
        arg = argv[i]
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
    """Extract model, host, port, TP size and memory fraction; ValueError names the bad option."""
    found, positionals = _options(argv)
    model = found.get("model")
    # `vllm serve MODEL ...`: the model is the positional after "serve".
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
    try:
        tp = int(found.get("tp", 1))
    except ValueError:
        raise ValueError(f"--tensor-parallel-size expects an integer, got {found['tp']!r}") from None
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size expects >= 1, got {tp}")
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
    return VllmArgs(model, found.get("host", DEFAULT_HOST), port, tp, util, found.get("served_name"), drain)
