"""The run model: every chat session, auto run and autopilot drive is a run.

One id format for all of them (:func:`new_run_id`): ``MODE-YYYYmmdd-HHMMSS-xxxxxx``. A
run's id is its worktree key, so its branch is ``turnstile/<run-id>``. A run starts from a
frozen :class:`RunSpec`; the :class:`RunSupervisor` writes its row, owns its session wrapper
(turn slots, stop, park), runs each turn (``run_turn(run_id, prompt)``) and recovers at
start-up.
"""

from typing import TYPE_CHECKING, Any

from engine.runs.ids import RUN_ID_PATTERN, RunMode, named_runs, new_run_id
from engine.runs.spec import AgentEnv, ChatPlace, PlaceId, RunSpec, place_id

if TYPE_CHECKING:
    from engine.runs.supervisor import (
        CutOffTurn,
        DriveProbe,
        Recovery,
        RunSession,
        RunSupervisor,
    )

_SUPERVISOR = frozenset({"CutOffTurn", "DriveProbe", "Recovery", "RunSession", "RunSupervisor"})


def __getattr__(name: str) -> Any:
    # Start-up time: the supervisor (and the workspaces and git under it) is imported when a
    # name of it is asked for, not by every command that reads a run id or an owner.
    if name in _SUPERVISOR:
        from engine.runs import supervisor

        return getattr(supervisor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RUN_ID_PATTERN",
    "AgentEnv",
    "ChatPlace",
    "CutOffTurn",
    "DriveProbe",
    "PlaceId",
    "Recovery",
    "RunMode",
    "RunSession",
    "RunSpec",
    "RunSupervisor",
    "named_runs",
    "new_run_id",
    "place_id",
]
