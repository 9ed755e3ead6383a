"""kimi-supervisor: run `vllm serve` as a well-behaved systemd Type=notify service."""

__version__ = "0.1.0"
