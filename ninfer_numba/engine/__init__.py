"""Generation loop, sampling, KV cache, CUDA graphs, the public LLM API."""
