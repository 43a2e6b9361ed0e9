#!/usr/bin/env python3
"""Make the compose files' seccomp profile: Docker's default, plus what bubblewrap needs.

Usage: ``python3 deploy/seccomp_bwrap.py [DOCKER_PROFILE] > deploy/seccomp-bwrap.json``

DOCKER_PROFILE is Docker's default seccomp profile in its JSON format (a file; ``-`` or
nothing: standard input), e.g. the one your Docker release ships, from
https://github.com/moby/profiles (``seccomp/default.json``). What comes out is that
profile as it applies to a container without capabilities on x86-64 and arm64 (a rule
that needs a capability is left out, as Docker leaves it out for such a container), with
one rule of ours first: ``clone``, ``unshare``, ``mount``, ``umount2`` and ``pivot_root``
allowed, which bubblewrap needs to make an agent's sandbox. Without capabilities the
kernel allows them only inside a user namespace the caller made itself.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SANDBOX_CALLS = ["clone", "mount", "pivot_root", "umount2", "unshare"]
ARCHES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64")
# Docker's names for the architectures of those two (and their 32-bit modes).
_OURS = {"amd64", "arm64", "x86", "x32", "arm"}
_COMMENT = (
    "turnstile: bubblewrap makes the sandbox of each agent with these: clone and unshare "
    "for new namespaces under a user namespace of its own, mount, umount2 and pivot_root "
    "for its mounts. Without capabilities the kernel allows them only inside a user "
    "namespace the caller made."
)


def _applies(rule: dict[str, Any]) -> bool:
    """Whether Docker applies ``rule`` to a container without capabilities here."""
    includes = rule.get("includes") or {}
    if includes.get("caps"):
        return False
    arches = includes.get("arches")
    return not arches or bool(_OURS & set(arches))


def sandbox_profile(docker: dict[str, Any]) -> dict[str, Any]:
    """``docker``'s profile for a container without capabilities, with the sandbox's calls."""
    rules = []
    for rule in docker.get("syscalls", []):
        if not _applies(rule):
            continue
        kept = {k: v for k, v in rule.items() if k != "excludes"}
        # Docker allows clone only with no namespace flags, unless the container may
        # CAP_SYS_ADMIN; ours allows it outright, so its conditional rule goes.
        if kept.get("names") == ["clone"] and kept.get("args"):
            continue
        rules.append(kept)
    return {
        "defaultAction": docker["defaultAction"],
        "defaultErrnoRet": docker.get("defaultErrnoRet", 1),
        "archMap": [a for a in docker.get("archMap", []) if a.get("architecture") in ARCHES],
        "syscalls": [
            {"names": SANDBOX_CALLS, "action": "SCMP_ACT_ALLOW", "comment": _COMMENT},
            *rules,
        ],
    }


def main(argv: list[str]) -> int:
    source = argv[1] if len(argv) > 1 else "-"
    if source == "-":
        docker = json.load(sys.stdin)
    else:
        with open(source, encoding="utf-8") as fh:
            docker = json.load(fh)
    json.dump(sandbox_profile(docker), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
