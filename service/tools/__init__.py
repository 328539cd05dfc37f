"""Tool calls and reasoning: the model families' formats, incremental parsing, answer plans."""
