"""Linear layers beyond nn.Linear: weight-only quantized ones (`quantized.py`, kernel in `csrc/`)."""
