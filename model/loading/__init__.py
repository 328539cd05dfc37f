"""From a model name to weights on a device: presets, checkpoint directories and hub ids
(`loading`), safetensors files (`weight_files`, `checkpoint`), the Hugging Face cache (`hub`),
`generation_config.json`, tokenizers, LoRA adapter files (`lora`), and quantized weights (`quant`:
on-the-fly int8/int4, GPTQ, AWQ). It reads files; what runs with them lives in `model.engine`.
"""
