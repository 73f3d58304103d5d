"""Plumbing every layer may use: errors, units, files, the on-disk cache, secrets, interrupt handling, version."""
