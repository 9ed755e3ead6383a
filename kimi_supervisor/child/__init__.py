"""The child vLLM: spawn plan, the process and its tree, its output lines, readiness."""
