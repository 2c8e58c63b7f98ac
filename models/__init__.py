"""Functional Llama-family decoders, HF checkpoint I/O, tiny-model builders and training."""
