"""The OpenAI-compatible API family: its request models (`protocol`), the completions and chat
handlers over the engine (`serving`), and its response bodies and stream chunks (`formats`).
"""
