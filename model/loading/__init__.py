"""From a model name to weights on a device: presets, checkpoint directories and hub ids
(`loading`), safetensors files (`weight_files`, `checkpoint`), the Hugging Face cache (`hub`),
`generation_config.json` and tokenizers.
"""
