"""The FastAPI app of one engine replica: every API family mounted on the HTTP edge."""
