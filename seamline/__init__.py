"""seamline: one large language model served across several ordinary machines."""

__version__ = "0.1.0"
