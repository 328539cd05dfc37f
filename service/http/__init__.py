"""The HTTP edge every API family stands on: one request's call into the engine through the
admission gate and the tenant's quota (`engine_call`), SSE event streams (`event_stream`), images
fetched and decoded from requests (`images`) and HTTP carried over a Serve handle
(`asgi_forward`). It sits above `service.engine` and `service.tenancy` and imports no API family:
`service.openai`, `service.anthropic` and `service.explorer` build on it, and `service.server`
mounts them all.
"""
