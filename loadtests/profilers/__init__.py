"""torch.profiler breakdowns of engine steps (`profile_step`, `profile_moe`), also used by the benchmarks."""
