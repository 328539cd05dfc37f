"""qkv-serve's service: Ray Serve deployments (the engine replica with its HTTP edge, the prefix router, metrics)
and the HTTP API families over them (`openai`, the attention API). Imports `model`, never the
reverse.
"""
