"""Load tests, benchmarks and their tools: scripts run as `python loadtests/<part>/<script>.py`
(or `locust -f loadtests/locustfile.py`), importing each other as `loadtests.<part>.<module>` with
the repository root on `sys.path`. Not part of the installed package.
"""
