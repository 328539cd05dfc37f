"""From logits to tokens: `SamplingParams` and its one table of ranges (`params`), the batched
sampler (`sampler`), structured outputs through grammars (`structured`), and the request check
the engine and the HTTP edge share (`request_checks`). `params` and `request_checks` never
import torch.
"""
