"""The run model: every chat session, auto run and autopilot drive is a run.

One id format for all of them (:func:`new_run_id`): ``MODE-YYYYmmdd-HHMMSS-xxxxxx``. A
run's id is its worktree key, so its branch is ``turnstile/<run-id>``. A run starts from a
frozen :class:`RunSpec`; the :class:`RunSupervisor` writes its row, owns its session wrapper
(turn slots, stop, park), runs each turn (``run_turn(run_id, prompt)``) and recovers at
start-up.
"""

from engine.runs.ids import RUN_ID_PATTERN, RunMode, named_runs, new_run_id
from engine.runs.spec import AgentEnv, ChatPlace, RunSpec
from engine.runs.supervisor import (
    CutOffTurn,
    DriveProbe,
    Recovery,
    RunSession,
    RunSupervisor,
)

__all__ = [
    "RUN_ID_PATTERN",
    "AgentEnv",
    "ChatPlace",
    "CutOffTurn",
    "DriveProbe",
    "Recovery",
    "RunMode",
    "RunSession",
    "RunSpec",
    "RunSupervisor",
    "named_runs",
    "new_run_id",
]
