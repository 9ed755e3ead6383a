"""Liveness while serving: one deadline-bounded HTTP client, /health, canary, vLLM's /metrics, GPU events."""
