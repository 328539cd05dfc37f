"""The HTTP edge each engine replica serves: the FastAPI app (`api`), the error shape (`errors`),
one request's call into the engine (`engine_call`), the chat path every chat-like API shares
(`chat_template`, `chat_run`), the attention API (`attention_api`) and HTTP carried over a Serve
handle (`asgi_forward`). With the API families (`service.openai`, `service.anthropic`,
`service.tools`) it sits above `service.engine` and below the replica and the routing.
"""
