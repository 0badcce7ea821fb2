"""The package version, on the lowest floor so that any module (the CLI, the server's /version)
can read it without importing the public API above it."""

__version__ = "0.1.0"
