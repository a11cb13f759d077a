"""Model code: one implementation per family, parameterised by what this process owns."""
