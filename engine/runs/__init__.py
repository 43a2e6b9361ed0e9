"""The run model: every chat session, auto run and autopilot drive is a run.

One id format for all of them (:func:`new_run_id`): ``MODE-YYYYmmdd-HHMMSS-xxxxxx``. A
run's id is its worktree key, so its branch is ``turnstile/<run-id>``.
"""

from engine.runs.ids import RUN_ID_PATTERN, RunMode, new_run_id
from engine.runs.spec import AgentEnv, ChatPlace, RunSpec

__all__ = ["RUN_ID_PATTERN", "AgentEnv", "ChatPlace", "RunMode", "RunSpec", "new_run_id"]
