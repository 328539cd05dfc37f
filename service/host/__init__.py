"""The Ray-free host of one engine: its step thread and the streams of its callers."""
