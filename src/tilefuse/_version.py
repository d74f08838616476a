"""The package version: the one place it is written (pyproject.toml and the CLI read it here)."""
__version__ = "0.1.0"
