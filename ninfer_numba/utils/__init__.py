"""Small utilities: timing, machine description, offline wheelhouse."""
