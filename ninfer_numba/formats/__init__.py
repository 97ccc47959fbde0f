"""File formats: GGUF reader, quant layouts with NumPy dequantization, tokenizer and chat template.

Nothing here imports kernels."""
