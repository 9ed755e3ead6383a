"""The configuration: the TOML file read safely, its typed model, vLLM's arguments, and the stop timeouts."""
