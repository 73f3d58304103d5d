"""The package version, in a module of its own: modules of the library state it (result.json's
`tool`) without importing the package root, whose `tune()` sits above them all."""

__version__ = "0.1.0"
