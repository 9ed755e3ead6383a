"""The real-GPU tier (`python3 gpuaccept/gpu_tier --out DIR`); the entry and its steps are described in __main__.py."""
