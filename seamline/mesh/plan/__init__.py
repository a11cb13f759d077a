"""Planning: which node owns which layers. Pure functions over numbers (no I/O, no torch)."""
