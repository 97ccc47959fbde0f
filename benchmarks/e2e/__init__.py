"""End-to-end GPU checks: the whole GPU model against the NumPy reference model."""
