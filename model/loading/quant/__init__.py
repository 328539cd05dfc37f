"""Quantized weights at load time: the scheme (`scheme.py`), on-the-fly int8/int4 and the layer
swap (`quantize.py`), and the checkpoint formats GPTQ (`gptq.py`) and AWQ (`awq.py`)."""
