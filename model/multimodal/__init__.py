"""Images in: what a prompt's images become before the engine sees them (inputs.py), HF's image
processor from the checkpoint (processor.py), Qwen2-VL's M-RoPE positions (mrope.py) and the
encoder-output cache the runner keeps (encoder_cache.py)."""
