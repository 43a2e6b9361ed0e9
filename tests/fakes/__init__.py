"""Loopback fakes of external services for tests (see each module's docstring)."""
