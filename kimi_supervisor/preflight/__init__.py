"""The preflight phase: make the host ready for `vllm serve`, or say exactly why not.

run.py orders the phase (`Preflight`; this package imports none of its modules, so they
can import each other without a cycle through here); checks.py holds the deployment checks and
gpu_health.py the NVML health check; reaper.py plans and carries out the kill of
stale GPU occupants; shm.py removes stale shared-memory files; report.py renders
the dry-run report.  Waiting for GPU memory lives in gpu.py because the
supervisor's stop path waits too; the instance lock lives in instance_lock.py
because the CLI takes it before any phase.
"""
