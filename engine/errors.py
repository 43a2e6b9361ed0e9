"""The error tree of turnstile.

Every failure is a typed error that propagates; nothing pretends to succeed.
Messages never embed secrets: callers pass text through :func:`engine.redact.redact`
before it lands in an error, and output tails are capped.

```
TurnstileError                 every error turnstile raises on purpose (``retryable``: can
│                              trying the same thing again help?)
├── TurnError                  a turn could not run or finish
│   ├── TurnExecError          failed to spawn (missing binary, not executable)
│   ├── TurnIOError            failed to capture or parse what the agent produced
│   ├── TurnPreempted          a person stopped the turn
│   ├── TurnCutOff             the worker running the turn stopped answering (not re-run)
│   ├── TurnSuperseded         the turn was recorded ended meanwhile (its run moved on);
│   │                          its result is not kept
│   └── InvalidPromptError     refused before anything was spawned
├── ChannelError               a channel could not feed or publish
│   ├── ChannelRecvError
│   └── ChannelPublishError
├── ConfigError                bad settings or bad command-line input
│   ├── SandboxUnavailable     agents run in a sandbox that cannot be made here (engine.sandbox)
│   ├── ProjectError           unknown or badly configured project (engine.workspace.projects)
│   └── WorkflowError          the workflow file is invalid (engine.gates.workflow)
├── FileRefusedError           a file from or for a chat is refused (path, size, type)
├── TranscriptionError         the speech-to-text service failed or is not configured
├── UnsafeFileError            a file read for an agent is a link out of its folder, not a
│                              regular file, or too large
├── StoreError                 persistence failed (retryable)
│   ├── NotFoundError          no such run, task, ...
│   ├── StoreReadOnlyError     the database can be read but not written
│   ├── StoreUnreachableError  the database server refused us (address, password, URL)
│   └── SchemaTooNewError      the database was migrated by a newer turnstile
├── DriveRefused               an autopilot drive cannot start: driven already, complete,
│                              no project (engine.executors.drives)
├── GateRefused                a gated task refused a request; nothing changed
│                              (engine.gates.refusals: the reason maps to an exit code)
├── LockError                  a lock cannot be taken at all (its file is a link, a FIFO, ...)
│   └── LockBusyError          somebody else holds it (retryable)
├── GitError                   git could not be started, or exited non-zero
│   └── DiskFullError          ... because the disk is full (retryable)
└── WorkspaceError             a workspace operation failed (engine.workspace.errors)
    ├── WorkspaceBusyError     another run or process holds the worktree's lock (retryable)
    └── WorkspaceStateError    the worktree is not what turnstile left (damaged, dirty parent)
```

A class whose line names a module is defined there, beside the code that raises it (its
children with it); the others are defined here.
"""

from __future__ import annotations

__all__ = [
    "ChannelError",
    "ChannelPublishError",
    "ChannelRecvError",
    "ConfigError",
    "DiskFullError",
    "FileRefusedError",
    "GitError",
    "InvalidPromptError",
    "LockBusyError",
    "LockError",
    "NotFoundError",
    "SchemaTooNewError",
    "StoreError",
    "StoreReadOnlyError",
    "StoreUnreachableError",
    "TranscriptionError",
    "TurnCutOff",
    "TurnError",
    "TurnExecError",
    "TurnIOError",
    "TurnPreempted",
    "TurnSuperseded",
    "TurnstileError",
    "UnsafeFileError",
]


class TurnstileError(Exception):
    """Base of every error turnstile raises on purpose.

    Attributes:
        retryable: whether trying the same thing again can help.
    """

    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TurnError(TurnstileError):
    """A turn could not run to completion."""


class TurnExecError(TurnError):
    """The agent process could not be spawned."""

    def __init__(self, message: str, *, binary: str | None = None) -> None:
        super().__init__(message)
        self.binary = binary


class TurnIOError(TurnError):
    """The agent ran but its output could not be captured or understood."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class TurnPreempted(TurnError):
    """The in-flight turn was stopped by a person."""

    def __init__(self, message: str = "turn pre-empted", *, session_id: str | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id


class TurnSuperseded(TurnError):
    """The turn was recorded ended while it ran (its worker was declared lost and the run
    moved on): its result is not kept and the run is left to whoever has it now."""


class TurnCutOff(TurnError):
    """The worker running the turn stopped answering; the turn is reported, not re-run.

    Attributes:
        worker: the worker's name.
    """

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class InvalidPromptError(TurnError):
    """The prompt was refused before anything was spawned (empty, NUL byte, ...)."""


class ChannelError(TurnstileError):
    """A channel failed to yield a prompt or to publish an output."""


class ChannelRecvError(ChannelError):
    """Reading the next prompt failed."""


class ChannelPublishError(ChannelError):
    """Publishing a turn's output failed."""


class ConfigError(TurnstileError):
    """Settings or command-line input are invalid; the message says which and how to fix it."""

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class FileRefusedError(TurnstileError):
    """A file is not taken in or sent out: it leaves the run's folder, is too large, of a
    refused type, empty, or the folder it would go to is not a plain folder.

    Attributes:
        reason: a short machine-readable word (``size``, ``symlink``, ``type``, ...).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TranscriptionError(TurnstileError):
    """A voice note could not be turned into text (no service configured, or it failed).

    Attributes:
        status: the service's HTTP status, when it answered.
    """

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class UnsafeFileError(TurnstileError):
    """A file the engine reads on an agent's behalf was refused (see :mod:`engine.safefile`).

    Attributes:
        path: the file as asked for (inside its folder).
        reason: why, one of :class:`engine.safefile.Unsafe`'s values.
    """

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class StoreError(TurnstileError):
    """The store failed to read or write."""

    retryable = True


class NotFoundError(StoreError):
    """The thing asked for does not exist."""

    retryable = False


class LockError(TurnstileError):
    """A lock could not be taken at all (its file cannot be opened or is not a plain file)."""


class LockBusyError(LockError):
    """Somebody else holds the lock.

    Attributes:
        lock: what the lock guards (a path, a key).
        holder: the pid of the holder when known.
    """

    retryable = True

    def __init__(self, message: str, *, lock: str, holder: int | None = None) -> None:
        super().__init__(message)
        self.lock = lock
        self.holder = holder


class GitError(TurnstileError):
    """git could not be started, or exited non-zero where success was needed.

    Attributes:
        command: the git subcommand (``clone``, ``worktree``, ...), never the full argv.
        exit_code: git's exit code; None when git could not be started at all.
        stderr: the redacted tail of what git wrote to stderr.
    """

    def __init__(
        self,
        message: str,
        *,
        command: str,
        exit_code: int | None,
        stderr: str,
    ) -> None:
        super().__init__(message)
        self.command = command
        self.exit_code = exit_code
        self.stderr = stderr


class DiskFullError(GitError):
    """git ran out of disk space; freeing space and retrying can help."""

    retryable = True


class StoreReadOnlyError(StoreError):
    """The database opens but refuses writes (read-only file, folder or mount)."""

    retryable = False

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class StoreUnreachableError(StoreError):
    """The database server could not be reached or refused the connection.

    Attributes:
        target: where it was (credentials redacted).
    """

    def __init__(self, message: str, *, target: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.target = target
        self.retryable = retryable


class SchemaTooNewError(StoreError):
    """The database was migrated by a newer turnstile than this one."""

    retryable = False

    def __init__(self, message: str, *, owner: str, version: int, known: int) -> None:
        super().__init__(message)
        self.owner = owner
        self.version = version
        self.known = known
