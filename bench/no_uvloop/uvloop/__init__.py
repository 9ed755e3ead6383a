"""First on PYTHONPATH, this hides an installed uvloop: bench_front.py's asyncio-loop runs of the same front."""

raise ImportError("uvloop hidden by bench/no_uvloop (bench/front_standin.py)")
