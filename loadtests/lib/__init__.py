"""What the load tests, benchmarks and profilers share: the scripts under loadtests/ import these
modules (and model/, service/), never one another. Nothing here is a command.

- results: writing the result files (docs/results/*.json) and every JSON a script writes
- result_schema: what those files must hold (the docs' keys, the provenance); standard library only
- provenance: the command line, the git state and source digest, the machine
- rooflines: the machine's measured copy bandwidth and matmul peak
- checkpoints: random checkpoints of real models' shapes (dense and mixture-of-experts)
- workloads: the engine benchmarks' random requests
- engine_steps: driving an `Engine` step by step (prefilled batches, decode rates)
- step_profile, moe_profile: torch.profiler breakdowns of decode steps
- llama_cpp: building and running llama.cpp, and its batched-bench workload on the engine
- streaming_clients: the small SSE client and closed-loop streaming runs against a service
- think_clients: closed-loop streaming clients with a think time and an API key each (httpx)
- process_cpu: CPU per part of a running service (by process and thread)
- serve_env: Ray Serve's settings, applied before Ray Serve is imported
- held_load: many held streams and a soak with disconnects against one replica
- load_memory: peak resident memory while loading a checkpoint
- openai_workload: the OpenAI-API requests the Locust users send, and how a response is read
- load_summary: summaries and plots of a Locust sweep's records
"""
