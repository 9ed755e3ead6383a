"""What the tests, the benchmarks and the GPU acceptance harness share: fakes, the harness, /proc helpers."""
