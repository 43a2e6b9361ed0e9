"""``turnstile status``: list, create, show, check and move gated tasks; approve and reject.

Everything goes through the :class:`engine.gates.Gates` facade.

Exit codes: 0 done; 2 usage; 10-24 a refusal (see :class:`engine.gates.refusals.Refusal`
and docs/gates.md); 25 ``--validate-folder`` found violations; 26 ``--audit`` found
problems.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.commands._settings import ListingSettings, full_settings

if TYPE_CHECKING:
    from engine.gates.service import Gates
    from engine.settings import Settings

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="gated tasks: list, init, show, validate, transition, approve, reject, audit",
        description="Phase gates of tasks: each phase writes an artifact, and the phases that "
        "need approval wait for a person. Refusals exit with a code per reason; see "
        "docs/gates.md.",
    )
    parser.add_argument("--task", "-t", metavar="T", help="the task to act on")
    verbs = parser.add_mutually_exclusive_group()
    verbs.add_argument("--list", action="store_true", help="every task, by parent and wave")
    verbs.add_argument("--init", action="store_true", help="create the task at its first phase")
    verbs.add_argument(
        "--validate-folder",
        action="store_true",
        help="out-of-order or forbidden artifacts, and a .state that disagrees with the store",
    )
    verbs.add_argument(
        "--transition",
        metavar="PHASE[:awaiting_approval]",
        help="move the task to PHASE by hand (PHASE:awaiting_approval opens its gate); "
        "only moves the workflow allows",
    )
    verbs.add_argument("--approve", action="store_true", help="approve the open gate")
    verbs.add_argument("--reject", action="store_true", help="reject the open gate")
    verbs.add_argument("--audit", action="store_true", help="check every task")
    verbs.add_argument(
        "--artifact",
        action="store_true",
        help="print the artifact of the open gate (or of --sha256 HASH) as stored for review",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--folder", type=Path, help="task folder (default: TASKS_ROOT/T)")
    parser.add_argument("--workdir", type=Path, help="code workspace (default: the folder)")
    parser.add_argument("--parent", help="--init: the parent task")
    parser.add_argument("--wave", type=int, help="--init: the sub-task's wave (>= 1)")
    parser.add_argument("--summary", help="--init: one line describing the task")
    parser.add_argument("--by", metavar="USER", help="approver's numeric user id")
    parser.add_argument(
        "--reason", help="--reject: why (fed back to the agent); --transition: recorded"
    )
    parser.add_argument(
        "--sha256",
        metavar="HASH",
        help="--approve: the artifact hash you reviewed; --artifact: which one (>= 8 hex)",
    )
    # The listing reads only where the database is: it starts without the whole settings.
    parser.set_defaults(handler=run_status, listing=lambda args: args.list)


def _out(args: argparse.Namespace, payload: Any, text: str) -> None:
    if args.json:
        print(json.dumps(payload, indent=1, default=str))
    else:
        print(text)


async def run_status(args: argparse.Namespace, settings: Settings | ListingSettings) -> int:
    # Imported here: `turnstile --help` and other commands stay fast.
    from engine.gates.refusals import GateRefused

    try:
        return await _dispatch(args, settings)
    except GateRefused as exc:
        # Once: JSON on stdout with --json, else one line on stderr.
        if args.json:
            print(json.dumps({"refused": exc.reason.value, "detail": exc.detail, "line": exc.line}))
        else:
            print(f"turnstile: refused: {exc.reason.value}: {exc.detail}", file=sys.stderr)
        return exc.reason.exit_code


async def _dispatch(args: argparse.Namespace, given: Settings | ListingSettings) -> int:
    from engine.errors import ConfigError
    from engine.store.backend import open_database

    needs_task = args.init or args.validate_folder or args.transition or args.approve
    needs_task = needs_task or args.reject or args.artifact
    if needs_task and not args.task:
        raise ConfigError("this verb needs --task T")
    if (args.approve or args.reject) and not args.by:
        raise ConfigError("--approve and --reject need --by USER_ID")
    if args.reject and not args.reason:
        raise ConfigError("--reject needs --reason TEXT")
    if args.list:
        return await _list(args, given)
    settings = full_settings(given)
    from engine.gates.service import Gates

    async with open_database(settings) as db:
        gates = Gates(db, settings)
        if args.audit:
            return await _audit(args, gates)
        if not args.task:
            raise ConfigError("give --list, --audit, or --task T (see --help)")
        if args.init:
            task = await gates.init_task(
                args.task,
                folder=args.folder,
                workdir=args.workdir,
                parent=args.parent,
                wave=args.wave,
                summary=args.summary,
                started_by=args.by,
            )
            _out(args, {"task": task.name, "phase": task.label}, f"{task.name}: {task.label}")
            return 0
        if args.validate_folder:
            return await _validate(args, gates)
        if args.artifact:
            return await _artifact(args, gates)
        if args.transition:
            task = await gates.transition(
                args.task, args.transition, actor=args.by, reason=args.reason
            )
            _out(
                args,
                {"task": task.name, "phase": task.label, "version": task.version},
                f"{task.name}: {task.label} (v{task.version})",
            )
            return 0
        if args.approve or args.reject:
            if args.approve:
                result = await gates.approve(args.task, by=args.by, expected_sha256=args.sha256)
            else:
                result = await gates.reject(args.task, by=args.by, reason=args.reason)
            if result.reason is not None:
                if args.json:
                    _out(args, result.as_dict(), "")
                else:
                    print(
                        f"turnstile: refused: {result.reason.value}: {result.detail}",
                        file=sys.stderr,
                    )
                return result.reason.exit_code
            from engine.executors import gate_decided

            try:
                await gate_decided(settings, db, args.task)
            except Exception as exc:  # recorded all the same; its worker sees it a beat later
                print(
                    "turnstile: note: recorded; the drive goes on when its worker next "
                    f"checks, within seconds ({type(exc).__name__})",
                    file=sys.stderr,
                )
            text = f"{result.task}: {result.outcome.value} ({result.detail})"
            if result.subtasks_created:
                text += "\nsub-tasks created: " + ", ".join(result.subtasks_created)
            _out(args, result.as_dict(), text)
            return 0
        return await _show(args, gates)


async def _artifact(args: argparse.Namespace, gates: Gates) -> int:
    """The stored artifact (from the database: the task folder may be on a worker)."""
    name, stored = await gates.task_artifact(args.task, args.sha256)
    if args.json:
        payload = {
            "task": args.task,
            "artifact": name,
            "sha256": stored.sha256,
            "size": stored.size,
            "content": stored.content.decode("utf-8", errors="replace"),
        }
        print(json.dumps(payload, indent=1))
    else:
        sys.stdout.buffer.write(stored.content)
        sys.stdout.flush()
    return 0


async def _list(args: argparse.Namespace, settings: Settings | ListingSettings) -> int:
    from engine.commands._settings import listing_migrations
    from engine.gates.listing import ListEntry, group_tasks, render_groups_json, render_rows
    from engine.gates.store import SqlGateStore
    from engine.store.backend import open_database

    # Listing needs no workflow and no folders: one query (on one connection), then render;
    # and only the engine's tables, so the front ends' migrations are not looked up.
    async with open_database(settings, pooled=False, migrations=listing_migrations()) as db:
        rows = await SqlGateStore(db).listing_rows()
    if args.json:
        text = render_groups_json(group_tasks(map(ListEntry._make, rows)))
    else:
        text = render_rows(rows)
    sys.stdout.write(text + "\n")
    return 0


async def _show(args: argparse.Namespace, gates: Gates) -> int:
    view = await gates.show(args.task)
    task = view.task
    payload = {
        **view.snapshot,
        "folder": str(task.folder),
        "workdir": str(task.workdir),
        "return_phase": task.return_phase,
        "revision_notes": task.revision_notes,
        "next_step": view.next_step,
        "history": [
            {
                "version": h.version,
                "kind": h.kind,
                "from": f"{h.from_phase}:{h.from_sub}" if h.from_sub else h.from_phase,
                "to": f"{h.to_phase}:{h.to_sub}" if h.to_sub else h.to_phase,
                "actor": h.actor,
                "reason": h.reason,
                "sha256": h.sha256,
                "at": h.at,
            }
            for h in view.history
        ],
    }
    lines = [
        f"task      {task.name}"
        + (f" (sub-task of {task.parent}, wave {task.wave})" if task.parent else ""),
        f"phase     {task.label}   version {task.version}",
        f"folder    {task.folder}",
    ]
    if task.awaiting_approval:
        lines.append(
            f"gate      {str(task.gate_sha256)[:12]}  approvals {view.approvers}/{view.quorum}"
        )
        stored = await gates.artifact(str(task.gate_sha256))
        payload["gate_artifact_size"] = stored.size if stored is not None else None
        lines.append(
            f"artifact  {stored.size} bytes: turnstile status --task {task.name} --artifact"
            if stored is not None
            else "artifact  not in the database: it cannot be approved until it is"
        )
    if task.revision_notes:
        lines.append(f"notes     {task.revision_notes[:200]!r}")
    lines.append(f"next      {view.next_step}")
    for row in payload["history"][-10:]:
        lines.append(
            f"  v{row['version']:<4} {row['kind']:<10} {row['to']}"
            + (f"  by {row['actor']}" if row["actor"] else "")
            + (f"  ({str(row['reason'])[:60]})" if row["reason"] else "")
        )
    _out(args, payload, "\n".join(lines))
    return 0


async def _validate(args: argparse.Namespace, gates: Gates) -> int:
    from engine.gates.refusals import EXIT_VIOLATIONS

    task, violations = await gates.validate_folder(args.task)
    text = (
        f"{task.name}: folder OK at {task.label}"
        if not violations
        else "\n".join(f"{v.kind.value}: {v.detail}" for v in violations)
    )
    _out(args, {"task": task.name, "violations": [v.as_dict() for v in violations]}, text)
    return EXIT_VIOLATIONS if violations else 0


async def _audit(args: argparse.Namespace, gates: Gates) -> int:
    from engine.gates.refusals import EXIT_AUDIT_FINDINGS

    report = await gates.audit([args.task] if args.task else None)
    text = (
        f"audit: {report.tasks} tasks, no findings"
        if report.clean
        else "\n".join(f"{f.task}: {f.kind.value}: {f.detail}" for f in report.findings)
    )
    _out(args, report.as_dict(), text)
    return 0 if report.clean else EXIT_AUDIT_FINDINGS
