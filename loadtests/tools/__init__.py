"""Commands around the benchmarks and load tests: Locust sweeps and their reports, random
checkpoints of real shapes, prompt files for GuideLLM, the GPU device check."""
