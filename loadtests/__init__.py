"""Load tests, benchmarks and their tools: commands run as `python loadtests/<part>/<script>.py`
(or `locust -f loadtests/locustfile.py`) with the repository root on `sys.path`. A script is a
command, never a library: what two of them share lives in `loadtests.lib`, which imports no
script (tests/loadtests/test_loadtests_layout.py checks both). Not part of the installed package.
"""
