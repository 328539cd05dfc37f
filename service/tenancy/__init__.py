"""Many tenants on one service: API keys from a file (hashed at rest, reloaded without a restart),
each naming a tenant with its allowed models, rate limits, concurrency cap and default priority
(keys.py); the limits counted across replicas by one ledger (ledger.py) that each replica's
edge asks before a request runs (quotas.py); the key checked at the HTTP edge (auth.py).
"""
