"""Model definitions: the NumPy reference forward (the executable spec), weight loading, the GPU forward."""
