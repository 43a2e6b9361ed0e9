"""turnstile's Telegram front end: the only package that imports ``telegram``."""

__all__: list[str] = []
