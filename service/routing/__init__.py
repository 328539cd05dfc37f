"""Which engine replica serves a request: the prefix- and adapter-aware request router
(`router.PrefixAwareRouter`) and the deployment HAProxy asks for each request's replica
(`prefix_route.PrefixRoute`).
"""
