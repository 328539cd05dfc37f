"""The attention explorer's data side: which maps a request may ask for (`attention_spec`,
torch-free) and capturing them from the engine's attention layers (`attention_maps`).
"""
