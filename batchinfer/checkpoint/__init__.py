"""Checkpoint reading and writing: safetensors, quantization formats, presets."""
