"""Building blocks every architecture shares: attention over the paged KV cache (dot-product and
additive scoring) with its backends (the gather reference and the fused C++ kernel in `csrc/`),
the KV cache and per-step attention metadata, position encodings, norms and MLPs.
"""
