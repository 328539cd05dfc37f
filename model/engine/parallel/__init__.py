"""Tensor parallelism: a model split Megatron-style over Ray worker actors, one per rank.

- `sharding.py`: which slice of every weight a rank holds, the per-rank model (column-parallel
  Q/K/V and gate/up, row-parallel output/down projections with one all-reduce each,
  vocabulary-parallel embedding and LM head) and its shard-by-shard loading.
- `worker.py`: the worker actor: its rank's model and KV cache (its heads only), one forward per step.
- `driver.py`: `TensorParallelRunner`, the engine's runner (the `ModelRunner.run` contract): one small
  message per step to every worker, the logits rows back from rank 0, sampling in the driver.

Only this sub-package of `model/` imports Ray, and only when tensor_parallel_size > 1.
"""

from model.engine.parallel.errors import WorkerDiedError

__all__ = ["WorkerDiedError"]
