"""qkv-serve's service: Ray Serve deployments (the ingress, the engine replica, routing, metrics)
and the HTTP API families over them (`openai`, the attention API). Imports `model`, never the
reverse.
"""
