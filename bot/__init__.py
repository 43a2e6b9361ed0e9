"""turnstile's Telegram front end: the only package that imports ``telegram`` (what any
chat front end shares is in ``chatfront``)."""

__all__: list[str] = []
