"""The KV cache's tiers around the model's paged pool: the block manager that hands out its blocks
and hashes full ones for prefix caching (`block_manager.py`), the host-memory offload tier
(`offload.py`), the tier shared by the replicas of a node (`share.py`, file layout in
`share_layout.py`), blocks moved between engines for prefill/decode disaggregation
(`transfer.py`), and the events that report which blocks the pool holds (`events.py`)."""
