"""The files in deploy/: systemd units verified by systemd, the Dockerfile linted and its
agent-install step run, the compose file and the nginx example checked for consistency.

No Docker engine runs here, so the image itself is not built.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.agents.factory import AGENT_NAMES
from engine.sandbox import Walls, probe_sandbox
from tests.agent_clis import PINNED

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = ("turnstile.service", "turnstile-backup.service", "turnstile-backup.timer")
IN_CI = bool(os.environ.get("CI"))


def _tool(name: str) -> str:
    """The path of ``name``; CI installs it (see .ci/run), elsewhere a missing one skips."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if IN_CI:
            pytest.fail(f"{name} is not installed: .ci/run must install it")
        pytest.skip(f"{name} is not installed")
    return found


# --- systemd -------------------------------------------------------------------------


def _unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment; systemd allows repeated keys."""
    entries, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def _values(path: Path, key: str) -> list[str]:
    return [v for _, k, v in _unit_entries(path) if k == key]


def _environment(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in _values(path, "Environment"):
        for word in shlex.split(value):
            name, _, val = word.partition("=")
            env[name] = val
    return env


def _installable_copy(unit: str, folder: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's turnstile (verify checks it exists).

    Only the executable's path changes; every other line is verified as shipped.
    """
    text = (DEPLOY / unit).read_text()
    assert "/opt/turnstile/.venv/bin/turnstile" in text or unit.endswith(".timer")
    turnstile = Path(sys.executable).with_name("turnstile")
    text = text.replace("/opt/turnstile/.venv/bin/turnstile", str(turnstile))
    copy = folder / unit
    copy.write_text(text)
    return copy


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("systemd-analyze"), "verify", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
        cwd=paths[0].parent,
        timeout=60,
    )


def test_systemd_units_verify_clean(tmp_path: Path) -> None:
    copies = [_installable_copy(unit, tmp_path) for unit in UNITS]
    result = _verify(copies)
    # verify exits 0 on "Unknown key ..., ignoring": any message at all is a finding.
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_systemd_verify_catches_a_typo(tmp_path: Path) -> None:
    copy = _installable_copy("turnstile.service", tmp_path)
    copy.write_text(copy.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    result = _verify([copy])
    assert "Unknown key" in result.stderr
    assert "NoNewPrivilege" in result.stderr


def test_systemd_exposure_score_is_low(tmp_path: Path) -> None:
    copy = _installable_copy("turnstile.service", tmp_path)
    result = subprocess.run(
        [_tool("systemd-analyze"), "security", "--offline=true", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    # 1.7 before the agents' sandbox; what bubblewrap needs opened (user, mount and pid
    # namespaces, its mounts, an unmasked /proc) costs about 1.1: the agent behind the
    # walls is worth more than the points (docs/security.md).
    assert float(match.group(1)) <= 3.0, result.stdout


def test_service_hardening_and_restart_policy() -> None:
    unit = DEPLOY / "turnstile.service"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "KillMode": "mixed",
        "User": "turnstile",
    }.items():
        assert _values(unit, key) == [value], key
    assert _values(unit, "ExecStart")[0].endswith("/turnstile bot")
    assert _values(unit, "CapabilityBoundingSet") == [""]


@pytest.mark.parametrize("unit", ["turnstile.service", "turnstile-backup.service"])
def test_database_and_workspaces_are_the_writable_paths(unit: str) -> None:
    path = DEPLOY / unit
    writable = [Path(p.lstrip("-")) for v in _values(path, "ReadWritePaths") for p in v.split()]
    assert writable
    env = _environment(path)
    folders = [Path(env["TURNSTILE_DATABASE"]).parent]
    if "TURNSTILE_WORKSPACES" in env:
        folders.append(Path(env["TURNSTILE_WORKSPACES"]))
    if unit == "turnstile.service":
        assert "TURNSTILE_WORKSPACES" in env
        folders.append(Path(env["HOME"]))  # the agents' sessions, needed to resume
    # Relative paths in the EnvironmentFile (which wins over Environment=) land here.
    folders.append(Path(_values(path, "WorkingDirectory")[0]))
    for folder in folders:
        assert any(folder.is_relative_to(w) for w in writable), (folder, writable)


# --- Docker --------------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    result, pending = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    instructions = _instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def test_dockerfile_lints_clean() -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_a_non_root_user_with_state_on_volumes() -> None:
    final = _final_stage(DEPLOY / "Dockerfile")
    users = [args for word, args in final if word == "USER"]
    assert users, "the runtime stage must switch user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    volumes = [v for word, args in final if word == "VOLUME" for v in yaml.safe_load(args)]
    env_text = " ".join(args for word, args in final if word == "ENV")
    env = dict(w.split("=", 1) for w in shlex.split(env_text) if "=" in w)
    for setting in ("TURNSTILE_DATABASE", "TURNSTILE_WORKSPACES"):
        path = Path(env[setting])
        assert any(path.is_relative_to(v) for v in volumes), (setting, volumes)
    assert any(Path(env["HOME"]).is_relative_to(v) for v in volumes)
    entrypoint = next(args for word, args in reversed(final) if word == "ENTRYPOINT")
    assert yaml.safe_load(entrypoint)[:3] == ["tini", "--", "turnstile"]
    assert next(args for word, args in reversed(final) if word == "CMD") == '["bot"]'


def test_dockerfile_pins_the_versions_the_tests_use() -> None:
    args = {
        name: value
        for word, rest in _instructions(DEPLOY / "Dockerfile")
        if word == "ARG"
        for name, _, value in [rest.partition("=")]
    }
    assert args["CLAUDE_CODE_VERSION"] == PINNED["claude"].version
    assert args["COPILOT_VERSION"] == PINNED["copilot"].version
    assert args["CODEX_VERSION"] == PINNED["codex"].version


def test_dockerfile_copies_only_what_exists_and_is_not_ignored() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for word, args in _instructions(DEPLOY / "Dockerfile"):
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert f"!{source.rstrip('/')}" in [i.rstrip("/") for i in ignore], source


def _agents_step(tmp_path: Path) -> str:
    """The agents stage's RUN step, installing into ``tmp_path`` instead of /opt/agents."""
    instructions = _instructions(DEPLOY / "Dockerfile")
    start = next(i for i, (w, a) in enumerate(instructions) if w == "FROM" and "AS agents" in a)
    run = next(args for word, args in instructions[start:] if word == "RUN")
    return run.replace("/opt/agents", str(tmp_path / "agents"))


def _run_agents_step(tmp_path: Path, agents: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "npm.log"
    npm = bin_dir / "npm"
    npm.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    npm.chmod(0o755)
    args = {
        name: value
        for word, rest in _instructions(DEPLOY / "Dockerfile")
        if word == "ARG" and "=" in rest
        for name, _, value in [rest.partition("=")]
    }
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "AGENTS": agents,
        "CLAUDE_CODE_VERSION": args["CLAUDE_CODE_VERSION"],
        "COPILOT_VERSION": args["COPILOT_VERSION"],
        "CODEX_VERSION": args["CODEX_VERSION"],
    }
    return subprocess.run(
        ["/bin/sh", "-eu", "-c", _agents_step(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _npm_installs(tmp_path: Path) -> list[str]:
    log = tmp_path / "npm.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split()[-1] for line in lines if line.startswith("install")]


def test_agent_build_argument_installs_the_chosen_clis(tmp_path: Path) -> None:
    result = _run_agents_step(tmp_path, "claude codex")
    assert result.returncode == 0, result.stderr
    assert _npm_installs(tmp_path) == [
        f"@anthropic-ai/claude-code@{PINNED['claude'].version}",
        f"@openai/codex@{PINNED['codex'].version}",
    ]
    assert (tmp_path / "agents" / "node_modules" / ".bin").is_dir()


@pytest.mark.parametrize("agent", [a for a in AGENT_NAMES if a != "command"])
def test_every_cli_agent_can_be_chosen(tmp_path: Path, agent: str) -> None:
    result = _run_agents_step(tmp_path, agent)
    assert result.returncode == 0, result.stderr
    spec = PINNED[agent]
    assert _npm_installs(tmp_path) == [f"{spec.package}@{spec.version}"]


def test_agent_build_argument_none_and_unknown(tmp_path: Path) -> None:
    none = _run_agents_step(tmp_path, "none")
    assert none.returncode == 0, none.stderr
    assert _npm_installs(tmp_path) == []
    assert (tmp_path / "agents" / "node_modules" / ".bin").is_dir()
    bogus = _run_agents_step(tmp_path, "claude bogus")
    assert bogus.returncode != 0
    assert "unknown agent 'bogus'" in bogus.stderr


def test_compose_file_matches_the_image() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    service = compose["services"]["turnstile"]
    build = service["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    ).resolve()
    assert "AGENTS" in build["args"]
    assert service["restart"] == "on-failure"
    assert service["stop_signal"] == "SIGTERM"
    assert service["env_file"] == ["../.env"]
    assert "no-new-privileges:true" in service["security_opt"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}
    assert set(mounts.values()) <= set(compose["volumes"])
    env = service["environment"]
    for setting in ("TURNSTILE_DATABASE", "TURNSTILE_WORKSPACES"):
        assert any(Path(env[setting]).is_relative_to(m) for m in mounts), setting
    final = _final_stage(DEPLOY / "Dockerfile")
    volumes = [v for word, args in final if word == "VOLUME" for v in yaml.safe_load(args)]
    assert sorted(mounts) == sorted(volumes)


def test_the_postgres_compose_file_layers_a_server_under_turnstile() -> None:
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    layer = yaml.safe_load((DEPLOY / "compose.postgres.yaml").read_text())
    server = layer["services"]["postgres"]
    turnstile = layer["services"]["turnstile"]
    assert set(layer["services"]) == {"postgres", "turnstile"}
    assert "turnstile" in base["services"]  # the layer only adds to the base service
    # The server keeps its data on a volume of its own and is never published.
    mounts = {m.split(":")[1]: m.split(":")[0] for m in server["volumes"]}
    assert mounts == {"/var/lib/postgresql/data": "pgdata"}
    assert set(layer["volumes"]) == {"pgdata"}
    assert "ports" not in server
    assert "pg_isready" in " ".join(server["healthcheck"]["test"])
    assert turnstile["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    # turnstile's URL names that server, its database and user; the password is never
    # written down, both take it from the same variable (compose refuses to start without).
    env = server["environment"]
    url = turnstile["environment"]["TURNSTILE_DATABASE"]
    password = "${TURNSTILE_PG_PASSWORD:?set TURNSTILE_PG_PASSWORD in .env}"
    assert env["POSTGRES_PASSWORD"] == password
    assert url == (
        f"postgresql://{env['POSTGRES_USER']}:{password}@postgres:5432/{env['POSTGRES_DB']}"
    )
    # The image has pg_dump for `turnstile backup`, of the server's major version.
    final = _final_stage(DEPLOY / "Dockerfile")
    installs = " ".join(args for word, args in final if word == "RUN")
    assert "postgresql-client" in installs
    assert "bookworm" in (DEPLOY / "Dockerfile").read_text()  # Debian 12: client 15
    assert server["image"] == "postgres:15"


# --- the agents' sandbox in a container ----------------------------------------------

# What bubblewrap needs beyond Docker's default profile, for a process without capabilities.
SANDBOX_CALLS = ["clone", "mount", "pivot_root", "umount2", "unshare"]
SECCOMP = DEPLOY / "seccomp-bwrap.json"  # made by MAKER on the operator's machine
MAKER = DEPLOY / "seccomp_bwrap.py"
SANDBOX_OPTIONS = [
    "no-new-privileges:true",
    f"seccomp={SECCOMP.name}",
    "systempaths=unconfined",
    "apparmor=unconfined",
]


def test_every_service_that_runs_agents_can_make_their_sandbox_and_gets_no_more() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    agents = {"turnstile", "worker-1", "worker-2"}
    assert agents <= set(compose["services"])
    for name in agents:
        service = compose["services"][name]
        assert service["security_opt"] == SANDBOX_OPTIONS, name
        # Compose reads the profile relative to the project folder, deploy/, where the
        # maker writes it (docs/deploy.md).
        assert MAKER.is_file()
        # Never root, never privileged, no capability: unmasked /proc and no AppArmor are
        # safe only for the image's own unprivileged user.
        for key in ("user", "privileged", "cap_add"):
            assert key not in service, (name, key)
        assert service["cap_drop"] == ["ALL"], name
        assert service["read_only"] is True, name
    # The PostgreSQL layer changes none of it.
    layer = yaml.safe_load((DEPLOY / "compose.postgres.yaml").read_text())
    turnstile = layer["services"]["turnstile"]
    for key in ("security_opt", "user", "privileged", "cap_add", "cap_drop"):
        assert key not in turnstile, key


def _maker() -> Any:
    spec = importlib.util.spec_from_file_location("seccomp_bwrap", MAKER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docker_like(allowed: list[str]) -> dict[str, Any]:
    """A profile in Docker's format, shaped as Docker's default is (our own sample)."""
    flags = 2114060288  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "archMap": [
            {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]},
            {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
            {"architecture": "SCMP_ARCH_S390X", "subArchitectures": ["SCMP_ARCH_S390"]},
        ],
        "syscalls": [
            {"names": allowed, "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": flags, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
                "excludes": {"caps": ["CAP_SYS_ADMIN"]},
            },
            {
                "names": ["clone3"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 38,
                "excludes": {"caps": ["CAP_SYS_ADMIN"]},
            },
            {
                "names": ["clone", "mount", "pivot_root", "setns", "umount2", "unshare"],
                "action": "SCMP_ACT_ALLOW",
                "includes": {"caps": ["CAP_SYS_ADMIN"]},
            },
            {
                "names": ["s390_pci_mmio_read"],
                "action": "SCMP_ACT_ALLOW",
                "includes": {"arches": ["s390x"]},
            },
        ],
    }


def test_the_profile_maker_adds_the_sandboxs_calls_to_dockers_default() -> None:
    made = _maker().sandbox_profile(_docker_like(["read", "write"]))
    assert (made["defaultAction"], made["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", 1)
    ours, *rest = made["syscalls"]
    assert ours["names"] == SANDBOX_CALLS
    assert ours["action"] == "SCMP_ACT_ALLOW"
    # What needs a capability is gone (the container has none), and so is the narrow
    # clone rule ours replaces; what is refused stays refused; other machines' calls go.
    assert [r["names"] for r in rest] == [["read", "write"], ["clone3"]]
    assert rest[1]["errnoRet"] == 38  # clone3: "not implemented", the C library uses clone
    assert not [r for r in made["syscalls"] if "excludes" in r or "includes" in r]
    allowed = {n for r in made["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    assert "setns" not in allowed
    arches = [a["architecture"] for a in made["archMap"]]
    assert arches == ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"]
    # As a command: Docker's profile in, ours out.
    done = subprocess.run(
        [sys.executable, str(MAKER), "-"],
        input=json.dumps(_docker_like(["read"])),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout)["syscalls"][0]["names"] == SANDBOX_CALLS


# Loads a profile in Docker's format for a process without capabilities with libseccomp
# (what runc does, in short), then runs argv under it. argv[1]: the profile; argv[2]: calls
# to leave out (comma separated); the rest: the command.
_UNDER_PROFILE = r"""
import ctypes, json, os, platform, sys
arch = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
subs = {"amd64": [b"x86", b"x32"], "arm64": [b"arm"]}[arch]
ALLOW = 0x7FFF0000
def errno(n): return 0x00050000 | (n & 0xFFFF)
ops = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
       "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib = ctypes.CDLL(os.environ["LIBSECCOMP"])
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [
    ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
profile = json.load(open(sys.argv[1]))
left_out = set(sys.argv[2].split(","))
ctx = lib.seccomp_init(errno(profile["defaultErrnoRet"]))
for sub in subs:
    lib.seccomp_arch_add(ctx, lib.seccomp_arch_resolve_name(sub))
kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
for rule in profile["syscalls"]:
    inc = rule.get("includes") or {}
    if inc.get("arches") and arch not in inc["arches"]:
        continue
    if "minKernel" in inc and kernel < tuple(int(x) for x in inc["minKernel"].split(".")):
        continue
    act = ALLOW if rule["action"] == "SCMP_ACT_ALLOW" else errno(rule.get("errnoRet", 1))
    args = rule.get("args") or []
    cmps = (Cmp * len(args))(
        *[Cmp(a["index"], ops[a["op"]], a["value"], a.get("valueTwo", 0)) for a in args])
    for name in rule["names"]:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if name not in left_out and nr >= 0:
            assert lib.seccomp_rule_add_array(ctx, act, nr, len(args), cmps) == 0, name
assert lib.seccomp_load(ctx) == 0
os.execvp(sys.argv[3], sys.argv[3:])
"""


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="the profile is for amd64/arm64"
)
def test_the_made_profile_lets_bubblewrap_make_an_agents_sandbox(tmp_path: Path) -> None:
    """The walls an agent gets, under a profile the maker made (loaded as a container
    would load it): every call this machine has allowed but the five and those Docker
    keeps for a capability, as in Docker's default; made with the maker's rule, refused
    without it.

    What a profile cannot show: Docker's masked /proc paths and its AppArmor profile, the
    other two options (docs/deploy.md says how each was measured)."""
    bwrap = _tool("bwrap")
    if probe_sandbox(bwrap) is not None:
        pytest.skip("bubblewrap cannot make a sandbox on this machine")
    library = ctypes.util.find_library("seccomp")
    if library is None:
        pytest.skip("libseccomp is not installed")
    seccomp = ctypes.CDLL(library)
    seccomp.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
    seccomp.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    names = []
    for number in range(1024):
        pointer = seccomp.seccomp_syscall_resolve_num_arch(0, number)  # this machine's
        if pointer:
            names.append(ctypes.string_at(pointer).decode())
    kept_for_a_capability = {*SANDBOX_CALLS, "setns", "clone3"}
    everyday = sorted(n for n in names if n not in kept_for_a_capability)
    profile = tmp_path / "seccomp-bwrap.json"
    profile.write_text(json.dumps(_maker().sandbox_profile(_docker_like(everyday))))
    walls = Walls(bwrap=bwrap, hidden=(), writable=(tmp_path,))
    argv = walls.wrap(["sh", "-c", "echo made > proof && cat proof"], tmp_path)

    def under(left_out: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", "-c", _UNDER_PROFILE, str(profile), ",".join(left_out), *argv],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            env={**os.environ, "LIBSECCOMP": library},
        )

    made = under([])
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "made"
    refused = under(SANDBOX_CALLS)
    assert refused.returncode != 0
    assert "bwrap" in refused.stderr


def test_nginx_example_matches_its_settings() -> None:
    text = (DEPLOY / "nginx.conf").read_text()
    url = re.search(r"TURNSTILE_WEBHOOK_URL=(\S+)", text)
    port = re.search(r"TURNSTILE_WEBHOOK_PORT=(\d+)", text)
    assert url is not None
    assert port is not None
    path = re.sub(r"^https://[^/]+", "", url.group(1))
    assert f"location = {path} {{" in text
    assert f"proxy_pass http://127.0.0.1:{port.group(1)};" in text


# --- the package the images and units install ----------------------------------------


@pytest.mark.timeout(180)
def test_the_wheel_ships_every_data_file(tmp_path: Path) -> None:
    """Docker and systemd install turnstile non-editable: migrations, workflow and
    templates must be inside the wheel, not only in the source tree."""
    # Build from what the Dockerfile copies, in a scratch folder (pip builds in place).
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("engine", "chatfront", "webview", "bot"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        check=False,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = out.glob("turnstile-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = [
        p.relative_to(ROOT).as_posix()
        for package in ("engine", "chatfront", "webview", "bot")
        for p in (ROOT / package).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert any(name.endswith(".sql") for name in data)
    missing = sorted(set(data) - shipped)
    assert not missing, f"not in the wheel (add them to package-data in pyproject.toml): {missing}"


# --- the documents that lead there ----------------------------------------------------


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize(
    "doc", ["README.md", "docs/deploy.md", "deploy/README.md", "docs/security.md"]
)
def test_relative_links_and_anchors_resolve(doc: str) -> None:
    path = ROOT / doc
    text = path.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{doc}: {link} -> {file} does not exist"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{doc}: no heading for #{anchor}"


def test_worker_template_verifies_clean_and_keeps_each_workers_folders_apart(
    tmp_path: Path,
) -> None:
    template = _installable_copy("turnstile-worker@.service", tmp_path)
    instance = template.rename(template.with_name("turnstile-worker@w1.service"))
    result = _verify([instance])
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr
    shipped = DEPLOY / "turnstile-worker@.service"
    [start] = _values(shipped, "ExecStart")
    assert start.endswith("turnstile worker --name %i --concurrency 2")
    env = _environment(shipped)
    assert env["TURNSTILE_EXECUTION"] == "workers"
    assert "%i" in env["TURNSTILE_WORKSPACES"]
    assert "%i" in env["TURNSTILE_RUNS_DIR"]
    assert _values(shipped, "KillSignal") == ["SIGTERM"]
