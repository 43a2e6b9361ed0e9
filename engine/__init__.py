"""turnstile's engine: everything that drives agents, usable without any chat."""

__all__: list[str] = []
