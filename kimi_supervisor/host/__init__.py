"""The host: GPUs (types, Protocol, NVML counters), process identity and table, the instance lock."""
