"""The architecture families, one module each (the paper's Transformer, GPT-2, Llama and its
kin), built from `model.layers`, with their checkpoint weight-name maps (`weight_map`) and the
registry from a config's `architectures[0]` to them. Model files do no I/O.
"""
