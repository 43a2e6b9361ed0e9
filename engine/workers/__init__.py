"""Turns as jobs on ``turnstile worker`` processes (``TURNSTILE_EXECUTION=workers``).

The bot and the terminal commands are the control plane: they record a run and put its
turns on a job queue (procrastinate, on the shared PostgreSQL database); workers take one
turn at a time, each in the worktree it holds for the run, and report through the store.
"""
