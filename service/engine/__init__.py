"""The engine inside a replica's process, below HTTP: the step loop on its own thread bridged to
asyncio (`engine_loop`), the replica's admission gate (`admission`), its Prometheus metrics
(`metrics`) and what the edge knows of the served model (`model_info`). Imports nothing else
from service/; everything else here builds on it.
"""
