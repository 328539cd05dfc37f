"""torch.profiler and py-spy breakdowns of engine steps and of the serving path (their shared
parts are in loadtests/lib: step_profile, moe_profile)."""
