"""Logging: the `Logger` type every module takes (a leaf), the journald transport, the fd writer."""
