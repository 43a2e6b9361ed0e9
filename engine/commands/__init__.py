"""Sub-commands of ``turnstile``; each module exposes ``register(subparsers)``."""
