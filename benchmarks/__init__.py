"""Benchmarks: ninfer against llama.cpp's llama-bench on the same GGUF (harness), records, plots, ceilings.

`python -m ninfer_numba bench` runs the harness; `python -m benchmarks.plot results` regenerates plots and
tables; `python -m benchmarks.llamacpp build` builds the baseline. See benchmarks/README.md.
"""
