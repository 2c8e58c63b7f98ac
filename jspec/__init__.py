"""jspec: a JAX LLM serving engine with load-adaptive, lossless speculative decoding."""
