"""kvflow: the CLI and the local stack (the top floor: it may import every other package)."""

__version__ = "0.1.0"
