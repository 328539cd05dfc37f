"""Every test process serves the way `make serve` does: `service.launch.SERVING_ENV` (HAProxy
in front of each engine replica's own port) is set before anything imports Ray Serve, whose
settings are read from the environment at import time, in this process and in the Ray it starts.
"""

import os

from service.launch import apply_serving_env

apply_serving_env()
# Tests stop replicas often (redeploys, teardown): HAProxy drops a stopped replica within a
# second or two here, so the drain's floor need not be Ray's 30 s production default.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
