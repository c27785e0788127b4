"""The package's version, importable without the package's lazy names."""

__version__ = "0.1.0"
