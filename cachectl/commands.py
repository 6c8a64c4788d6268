"""The bodies of the ``cachectl`` subcommands: parse nothing, call the library, print, return
an exit status. Called by ``cli.main`` with the parsed arguments and the model loader (which
only the CLI module obtains from the engine).

Exit status (documented in ``cli.py`` and docs/cachectl.md): 0 ok, 1 corruption found,
2 usage error, 3 missing or unavailable (any other failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditserve.cachectl.client import through_daemon
from ditserve.cachectl.errors import (
    CORRUPT,
    BuildError,
    CacheError,
    DaemonError,
    EntryCorruptError,
    Problem,
    UsageError,
)
from ditserve.cachectl.layout import default_socket
from ditserve.cachectl.model_build import ModelLoader
from ditserve.cachectl.progress import Progress

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
LoaderFn = Callable[[], ModelLoader]


def _entry_result(entry: Any) -> dict[str, Any]:
    return {"status": "ready", "key": entry.key, "path": str(entry.path), "built": entry.built,
            "via_recipe": entry.via_recipe, "bytes": entry.total_bytes,
            "validated_by": entry.validated_by}


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        how = "built" if result.get("built") else "joined"
        print(f"{result['status']} {result['key']} {result['path']} ({how})")


def _request(args: argparse.Namespace) -> Any:
    from ditserve.cachectl.identity import Placement
    from ditserve.cachectl.model_build import ModelRequest

    model_dir, checkpoint = model_paths(args)
    return ModelRequest(model_dir, args.dtype, args.revision,
                        Placement(sp_size=args.sp_size, sp_impl=args.sp_impl),
                        component=args.component, checkpoint=checkpoint)


def model_paths(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(model directory, checkpoint file or None) of ``--model [--base-model]``."""
    if getattr(args, "base_model", None) is None:
        if args.model.is_file():
            raise UsageError(f"{str(args.model)!r} is a checkpoint file: pass it with "
                             "--base-model DIR, the diffusers directory of its other "
                             "components (docs/formats.md)")
        return args.model.resolve(), None
    if not args.model.is_file():
        raise UsageError(f"--base-model goes with --model FILE (a DiT checkpoint file); "
                         f"{str(args.model)!r} is not a file")
    return args.base_model.resolve(), args.model.resolve()


def _local_ensure(root: Path, args: argparse.Namespace, progress: Progress,
                  loader: LoaderFn) -> dict[str, Any]:
    from ditserve.cachectl.model_build import ensure_model
    from ditserve.cachectl.store import CacheStore

    store = CacheStore(root, lock_timeout_s=args.timeout)
    request = _request(args)
    waited_shown = [False]

    def on_wait(waited: float) -> None:
        if not waited_shown[0]:
            progress.phase("another process is building this entry; waiting")
            waited_shown[0] = True

    with ensure_model(store, request, loader(), on_phase=progress.phase, on_wait=on_wait,
                      on_progress=progress.bytes) as entry:
        return _entry_result(entry)


class _DaemonCannotSeeModel(CacheError):
    pass


def _daemon_ensure(client: Any, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    deadline = time.monotonic() + args.timeout
    last_phase = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CacheError(f"the daemon did not finish within --timeout {args.timeout:.0f}s "
                             f"(last phase: {last_phase}); it keeps building, run ensure again")
        # Long-poll: the daemon answers as soon as the build ends, or after wait_s.
        model_dir, checkpoint = model_paths(args)
        status, body = client.ensure(str(model_dir), args.dtype, args.revision,
                                     wait_s=min(5.0, left), sp_size=args.sp_size,
                                     sp_impl=args.sp_impl, component=args.component,
                                     checkpoint=None if checkpoint is None else str(checkpoint))
        if body.get("phase") != last_phase:
            last_phase = body.get("phase")
            progress.phase(f"daemon: {last_phase}")
        prog = body.get("progress") or {}
        progress.bytes(int(prog.get("done_bytes") or 0), int(prog.get("total_bytes") or 0))
        if status == 200:
            return {**body, "via": "daemon"}
        if status == 400 and body.get("reason") == "bad_request" and model_dir.is_dir():
            # We see the model, the daemon does not (e.g. a PVC mounted only in this pod).
            raise _DaemonCannotSeeModel(f"the daemon cannot use {args.model}: {body.get('error')}")
        if status != 202:
            err = body.get("error") or body.get("detail") or body
            if body.get("reason") == "corrupt":
                key = body.get("key") or "?"
                raise EntryCorruptError(key, [Problem(key, None, f"daemon says: {err}")])
            raise CacheError(f"daemon: {err}")


ALL_COMPONENTS = "all"


def _components(args: argparse.Namespace, loader: LoaderFn) -> list[str]:
    """The DiTs to ensure: the one named, or with ``--component all`` every one the model has
    (an engine maps each from the cache; one left out is held in private memory instead)."""
    if args.component != ALL_COMPONENTS:
        return [args.component]
    if args.base_model is not None:
        return ["transformer"]  # a checkpoint file holds one DiT: the model's first
    try:
        return list(loader().components(args.model.resolve()))
    except Exception as e:  # the loader's own errors name what is wrong with the directory
        raise BuildError(f"{str(args.model)!r} is not a usable model directory: {e}") from e


def _daemon_only_ensure(client: Any, args: argparse.Namespace,
                        progress: Progress) -> dict[str, Any]:
    """Ensure through the daemon alone: this process may not write the cache (read-only mount),
    so a missing or restarting daemon is waited for, never replaced by a local build."""
    def ask(left: float) -> dict[str, Any]:
        try:
            return _daemon_ensure(client, argparse.Namespace(**{**vars(args), "timeout": left}),
                                  progress)
        except _DaemonCannotSeeModel as e:
            raise CacheError(f"{e}: the cachectl DaemonSet mounts only the node directories "
                             "the admin listed (chart value cachectl.modelHostPaths)") from e

    return through_daemon(client, ask, timeout_s=args.timeout, on_phase=progress.phase)


def _ensure_one(root: Path, args: argparse.Namespace, progress: Progress, loader: LoaderFn,
                client: Any) -> dict[str, Any]:
    if args.daemon_only:
        return _daemon_only_ensure(client, args, progress)
    result = None
    if not args.no_daemon and client.available():
        try:
            result = _daemon_ensure(client, args, progress)
        except _DaemonCannotSeeModel as e:
            progress.phase(f"{e}; building or joining here under the lock instead")
        except DaemonError as e:
            # The daemon died or restarted mid-request: its build lock died with it (or
            # its build still runs and we wait on the same lock, then join).
            progress.phase(f"{e}; building or joining here under the lock instead")
    else:
        progress.phase("no daemon on the socket; building or joining under the lock")
    return result if result is not None else _local_ensure(root, args, progress, loader)


def cmd_ensure(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.client import DaemonClient

    progress = Progress(enabled=not args.json)
    client = DaemonClient(args.socket or default_socket(root))
    deadline = time.monotonic() + args.timeout
    results = []
    try:
        components = _components(args, loader)
        for component in components:
            if len(components) > 1:
                progress.phase(f"component {component}")
            left = max(1.0, deadline - time.monotonic())
            one = argparse.Namespace(**{**vars(args), "component": component, "timeout": left})
            results.append(_ensure_one(root, one, progress, loader, client))
    finally:
        progress.done()
    for result in results:
        _emit(result, args.json)
    return EXIT_OK


def cmd_build(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    progress = Progress(enabled=not args.json)
    try:
        results = [_local_ensure(root, argparse.Namespace(**{**vars(args), "component": c}),
                                 progress, loader) for c in _components(args, loader)]
    finally:
        progress.done()
    for result in results:
        _emit(result, args.json)
    return EXIT_OK


def _model_status(problems: list[Problem]) -> str:
    if not problems:
        return "ok"
    return CORRUPT if any(p.kind == CORRUPT for p in problems) else problems[0].kind


def cmd_verify(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.pull_command import verify_models
    from ditserve.cachectl.store import CacheStore

    store = CacheStore(root, create=False, threads=args.threads)
    models = verify_models(root, args.keys or None)  # pulled models (cachectl pull)
    model_keys = {k for k, _ in models}
    runtime_keys = [k for k in args.keys if k not in model_keys] if args.keys else None
    reports = store.verify(runtime_keys) if runtime_keys is None or runtime_keys else []
    if args.json:
        print(json.dumps([r.to_json() for r in reports]
                         + [{"key": k, "kind": "model", "status": _model_status(p),
                             "problems": [str(x) for x in p]} for k, p in models],
                         sort_keys=True))
    else:
        for r in reports:
            rate = r.bytes_hashed / r.seconds / 1e9 if r.seconds > 0 else 0.0
            if r.skipped:
                print(f"SKIPPED {r.key}  ({r.skipped})")
            elif r.ok:
                print(f"OK      {r.key}  {r.bytes_hashed / 2**30:.2f} GiB  {rate:.2f} GB/s")
            else:
                print(f"{r.status.upper():<7} {r.key}")
                for p in r.problems:
                    print(f"  {p.file or '(entry)'}: {p.what}")
        for key, problems in models:
            print(f"{'OK' if not problems else _model_status(problems).upper():<7} {key}  (pulled model)")
            for p in problems:
                print(f"  {p.file or '(entry)'}: {p.what}")
        if not reports and not models:
            print("no entries")
    statuses = {r.status for r in reports} | {_model_status(p) for _, p in models}
    if CORRUPT in statuses:
        return EXIT_CORRUPT
    return EXIT_OK if statuses <= {"ok", "skipped"} else EXIT_UNAVAILABLE


def cmd_list(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.store import CacheStore

    infos = CacheStore(root, create=False).list_all()
    if args.json:
        print(json.dumps([i.to_json() for i in infos], sort_keys=True))
        return EXIT_OK
    print(f"{'KEY':<16} {'KIND':<7} {'SIZE':>10} {'DTYPE':<9} {'IN-USE':<6} {'LAST-USED':<20} "
          "CREATED               URI")
    for i in infos:
        dtype = (i.identity or {}).get("dtype", "?") if i.kind == "runtime" else "-"
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.last_used))
        note = f"  ({i.problem})" if i.problem else ""
        print(f"{i.key[:16]} {i.kind:<7} {i.bytes / 2**30:>8.2f}Gi {dtype:<9} "
              f"{'yes' if i.in_use else 'no':<6} {used:<20} {i.created_at or '?':<21} "
              f"{i.uri or '-'}{note}")
    return EXIT_OK


def cmd_gc(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.store import CacheStore

    report = CacheStore(root, create=False).gc(args.max_bytes, dry_run=args.dry_run,
                                               partial_max_age_s=args.partial_age)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for key in report.removed:
        print(f"{verb} {key}")
    for key in report.kept_in_use:
        print(f"kept   {key} (in use)")
    for key, why in report.skipped.items():
        print(f"kept   {key} ({why})")
    for key in report.partials_removed:
        print(f"{verb} .partial/{key} (an interrupted pull)")
    for key in report.partials_kept:
        print(f"kept   .partial/{key} (a pull runs, or it changed within --partial-age)")
    print(f"{report.bytes_before / 2**30:.2f} GiB -> {report.bytes_after / 2**30:.2f} GiB "
          f"(budget {args.max_bytes / 2**30:.2f} GiB)")
    return EXIT_OK


def cmd_rm(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.store import CacheStore, checked_key

    store = CacheStore(root, create=False)
    rc = EXIT_OK
    for key in map(checked_key, args.keys):
        if not store.exists(key):
            print(f"no entry {key}", file=sys.stderr)
            rc = EXIT_UNAVAILABLE
        elif store.remove(key):
            print(f"removed {key}")
        else:
            print(f"entry {key} is in use or being built or pulled; not removed",
                  file=sys.stderr)
            rc = EXIT_UNAVAILABLE
    return rc


def cmd_serve(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl import logs
    from ditserve.cachectl.daemon import DaemonConfig, serve

    # Absolute: the daemon hands out model paths that clients in other directories link to.
    root = Path(os.path.abspath(root))
    config = DaemonConfig(root=root, socket_path=args.socket or default_socket(root),
                          tcp=args.tcp, metrics_port=args.metrics_port,
                          metrics_host=args.metrics_host,
                          scrub_interval_s=args.scrub_interval,
                          scrub_rate_mib_s=args.scrub_rate_mib, max_builds=args.max_builds,
                          grace_s=args.grace_period)
    return serve(config, logs.setup(), loader())


def cmd_pull(root: Path, args: argparse.Namespace, loader: LoaderFn) -> int:
    from ditserve.cachectl.pull_command import cmd_pull as pull

    return pull(root, args, loader)


COMMANDS: dict[str, Callable[[Path, argparse.Namespace, LoaderFn], int]] = {
    "build": cmd_build, "ensure": cmd_ensure, "pull": cmd_pull, "verify": cmd_verify,
    "list": cmd_list, "gc": cmd_gc, "rm": cmd_rm, "serve": cmd_serve,
}
