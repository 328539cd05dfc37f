"""The engine replica as a Ray Serve deployment: the engine host with its HTTP edge in one process
(`engine_deployment`), and where a replica and its tensor-parallel workers run (`placement`).
"""
