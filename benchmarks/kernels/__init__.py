"""Kernel microbenchmarks: bench_<family>.py files run by pytest with the plumbing in conftest.py."""
