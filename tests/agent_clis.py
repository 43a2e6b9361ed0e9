"""The real agent CLIs, installed from the npm registry at pinned versions, cached.

Each CLI goes into its own folder, ``<cache>/<name>``, with
``npm install --prefix <cache>/<name> <package>@<version>``; a folder that already holds
the pinned version is reused, so CI can cache ``<cache>`` between runs. The cache is
``$TURNSTILE_CLI_CACHE`` or ``<repo>/.cache/agent-clis`` (gitignored).

A failed install raises :class:`CliInstallError`: tests that need a CLI fail, they are
never skipped, so CI really runs them. Run ``python tests/agent_clis.py [name ...]`` to
install ahead of the tests (CI can do that in its own step).

Versions were measured on this machine (see ``docs/agents.md``); flags drift between
releases, so bump them deliberately and re-read each CLI's ``--help``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PINNED", "CliInstallError", "CliSpec", "cache_root", "ensure_cli"]

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class CliSpec:
    """One pinned CLI: its npm package, version and binary name."""

    name: str
    package: str
    version: str
    binary: str


PINNED: dict[str, CliSpec] = {
    "claude": CliSpec("claude", "@anthropic-ai/claude-code", "2.1.197", "claude"),
    "copilot": CliSpec("copilot", "@github/copilot", "1.0.102", "copilot"),
    "codex": CliSpec("codex", "@openai/codex", "0.171.0", "codex"),
}


class CliInstallError(RuntimeError):
    """npm could not install a pinned CLI (the message carries npm's output tail)."""


def cache_root() -> Path:
    """Where the CLIs are cached."""
    configured = os.environ.get("TURNSTILE_CLI_CACHE")
    return Path(configured).expanduser() if configured else REPO / ".cache" / "agent-clis"


def _installed_version(folder: Path, spec: CliSpec) -> str | None:
    manifest = folder / "node_modules" / spec.package / "package.json"
    try:
        version = json.loads(manifest.read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError):
        return None
    return version if isinstance(version, str) else None


def ensure_cli(name: str) -> Path:
    """The pinned CLI's binary, installing it into the cache first if needed.

    Safe to call from several processes at once (a lock file serialises installs).

    Raises:
        CliInstallError: npm is missing or the install failed.
    """
    spec = PINNED[name]
    folder = cache_root() / name
    binary = folder / "node_modules" / ".bin" / spec.binary
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version(folder, spec) == spec.version and binary.exists():
            return binary
        npm = shutil.which("npm")
        if npm is None:
            raise CliInstallError(
                f"npm is not on PATH: cannot install {spec.package}@{spec.version} "
                "(install Node.js 20+ with npm)"
            )
        argv = [
            npm,
            "install",
            "--prefix",
            str(folder),
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            f"{spec.package}@{spec.version}",
        ]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CliInstallError(f"`{' '.join(argv)}` failed: {exc}") from exc
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-3000:]
            raise CliInstallError(f"`{' '.join(argv)}` exited with {done.returncode}:\n{output}")
        if _installed_version(folder, spec) != spec.version or not binary.exists():
            raise CliInstallError(
                f"npm reported success but {binary} (version {spec.version}) is missing"
            )
        return binary


def main(names: list[str]) -> int:
    for name in names or list(PINNED):
        path = ensure_cli(name)
        version = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=120, check=False
        )
        first = (version.stdout.strip().splitlines() or ["?"])[0]
        print(f"{name}: {path} ({first})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
