"""The ``cachectl`` command line: a thin shell over the store, the model builder and the daemon.

Subcommands: build, ensure, verify, list, gc, rm, serve (``cachectl COMMAND --help``).
``--root`` is accepted before or after the subcommand; default ``$DITSERVE_CACHE_ROOT``, else
/var/cache/ditserve. Exit status: 0 ok, 1 corruption found, 2 usage error, 3 other failure
(timeout, missing entry, build error, daemon error).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import CacheError, EntryCorruptError, Problem
from ditserve.cachectl.identity import DTYPES
from ditserve.cachectl.layout import default_root, default_socket

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1073741824', '10G', '512MiB' -> bytes (binary units)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500M, 10G or 1073741824")
    unit = (m.group(2) or "B")[0].upper()
    return int(float(m.group(1)) * {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def _tcp(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="cache root (default: $DITSERVE_CACHE_ROOT or /var/cache/ditserve)")
    p = argparse.ArgumentParser(prog="cachectl", parents=[common],
                                description="Node-local runtime weight cache for ditserve.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", required=True, type=Path, help="local diffusers model directory")
        sp.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="runtime dtype")
        sp.add_argument("--revision", default=None, help="revision label recorded in the identity")
        sp.add_argument("--sp-size", type=int, default=1,
                        help="sequence-parallel world size of the engines (part of the identity)")
        sp.add_argument("--sp-impl", default=None,
                        help="sequence-parallel implementation name (with --sp-size > 1)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")

    b = sub.add_parser("build", parents=[common], help="build (or join) a model's entry here")
    model_args(b)
    b.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds to wait for another builder of the same entry")

    e = sub.add_parser("ensure", parents=[common],
                       help="build-or-join through the node daemon, else under the lock here")
    model_args(e)
    e.add_argument("--socket", type=Path, default=None,
                   help="daemon socket (default: $DITSERVE_CACHECTL_SOCKET or ROOT/cachectl.sock)")
    e.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait in total")
    e.add_argument("--no-daemon", action="store_true", help="never ask the daemon")

    v = sub.add_parser("verify", parents=[common], help="re-hash entries; exit 1 on corruption")
    v.add_argument("keys", nargs="*", metavar="KEY", help="entries to check (default: all)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--threads", type=int, default=None, help="hashing threads (default: cores)")

    ls = sub.add_parser("list", parents=[common], help="list entries")
    ls.add_argument("--json", action="store_true")

    g = sub.add_parser("gc", parents=[common], help="remove unused entries, LRU first")
    g.add_argument("--max-bytes", type=parse_size, default=0,
                   help="keep at most this many bytes (500M, 10G, ...; default 0)")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    g.add_argument("--json", action="store_true")

    r = sub.add_parser("rm", parents=[common], help="remove entries now (refused while in use)")
    r.add_argument("keys", nargs="+", metavar="KEY")

    s = sub.add_parser("serve", parents=[common], help="run the node daemon")
    s.add_argument("--socket", type=Path, default=None)
    s.add_argument("--tcp", type=_tcp, default=None, metavar="HOST:PORT",
                   help="also serve the API on TCP")
    s.add_argument("--metrics-port", type=int, default=None, help="Prometheus port")
    s.add_argument("--scrub-interval", type=float, default=6 * 3600.0, metavar="S",
                   help="seconds between scrubs (0 disables)")
    s.add_argument("--scrub-rate-mib", type=float, default=256.0, metavar="MIB_S",
                   help="scrub read rate limit in MiB/s (0: unlimited)")
    s.add_argument("--max-builds", type=int, default=2, help="concurrent builds")
    return p


class _Progress:
    """A tqdm bar over bytes on a terminal; a line per phase otherwise (logs stay readable)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.tty = sys.stderr.isatty()

    def phase(self, text: str) -> None:
        if self.enabled:
            self._close()
            print(f"cachectl: {text}", file=sys.stderr, flush=True)

    def bytes(self, done: int, total: int) -> None:
        if not (self.enabled and self.tty and total):
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def done(self) -> None:
        self._close()


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


def _placement(args: argparse.Namespace) -> Any:
    from ditserve.cachectl.identity import Placement

    return Placement(sp_size=args.sp_size, sp_impl=args.sp_impl)


def _local_ensure(root: Path, args: argparse.Namespace, progress: _Progress) -> dict[str, Any]:
    from ditserve.cachectl.model_build import ModelRequest, ensure_model
    from ditserve.cachectl.store import CacheStore

    store = CacheStore(root, lock_timeout_s=args.timeout)
    request = ModelRequest(args.model.resolve(), args.dtype, args.revision, _placement(args))
    waited_shown = [False]

    def on_wait(waited: float) -> None:
        if not waited_shown[0]:
            progress.phase("another process is building this entry; waiting")
            waited_shown[0] = True

    with ensure_model(store, request, on_phase=progress.phase, on_wait=on_wait,
                      on_progress=progress.bytes) as entry:
        return _entry_result(entry)


class _DaemonCannotSeeModel(CacheError):
    pass


def _daemon_ensure(client: Any, args: argparse.Namespace, progress: _Progress) -> dict[str, Any]:
    deadline = time.monotonic() + args.timeout
    last_phase = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CacheError(f"the daemon did not finish within --timeout {args.timeout:.0f}s "
                             f"(last phase: {last_phase}); it keeps building, run ensure again")
        # Long-poll: the daemon answers as soon as the build ends, or after wait_s.
        status, body = client.ensure(str(args.model.resolve()), args.dtype, args.revision,
                                     wait_s=min(5.0, left), sp_size=args.sp_size,
                                     sp_impl=args.sp_impl)
        if body.get("phase") != last_phase:
            last_phase = body.get("phase")
            progress.phase(f"daemon: {last_phase}")
        prog = body.get("progress") or {}
        progress.bytes(int(prog.get("done_bytes") or 0), int(prog.get("total_bytes") or 0))
        if status == 200:
            return {**body, "via": "daemon"}
        if status == 400 and body.get("reason") == "bad_request" and args.model.is_dir():
            # We see the model, the daemon does not (e.g. a PVC mounted only in this pod).
            raise _DaemonCannotSeeModel(f"the daemon cannot use {args.model}: {body.get('error')}")
        if status != 202:
            err = body.get("error") or body.get("detail") or body
            if body.get("reason") == "corrupt":
                key = body.get("key") or "?"
                raise EntryCorruptError(key, [Problem(key, None, f"daemon says: {err}")])
            raise CacheError(f"daemon: {err}")


def _cmd_ensure(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl.client import DaemonClient

    progress = _Progress(enabled=not args.json)
    client = DaemonClient(args.socket or default_socket(root))
    try:
        result = None
        if not args.no_daemon and client.available():
            try:
                result = _daemon_ensure(client, args, progress)
            except _DaemonCannotSeeModel as e:
                progress.phase(f"{e}; building or joining here under the lock instead")
        else:
            progress.phase("no daemon on the socket; building or joining under the lock")
        if result is None:
            result = _local_ensure(root, args, progress)
    finally:
        progress.done()
    _emit(result, args.json)
    return EXIT_OK


def _cmd_build(root: Path, args: argparse.Namespace) -> int:
    progress = _Progress(enabled=not args.json)
    try:
        result = _local_ensure(root, args, progress)
    finally:
        progress.done()
    _emit(result, args.json)
    return EXIT_OK


def _cmd_verify(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl.store import CacheStore

    store = CacheStore(root, threads=args.threads)
    reports = store.verify(args.keys or None)
    if args.json:
        print(json.dumps([r.to_json() for r in reports], sort_keys=True))
    else:
        for r in reports:
            rate = r.bytes_hashed / r.seconds / 1e9 if r.seconds > 0 else 0.0
            if r.ok:
                print(f"OK      {r.key}  {r.bytes_hashed / 2**30:.2f} GiB  {rate:.2f} GB/s")
            else:
                print(f"CORRUPT {r.key}")
                for p in r.problems:
                    print(f"  {p.file or '(entry)'}: {p.what}")
        if not reports:
            print("no entries")
    return EXIT_OK if all(r.ok for r in reports) else EXIT_CORRUPT


def _cmd_list(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl.store import CacheStore

    infos = CacheStore(root).list()
    if args.json:
        print(json.dumps([i.to_json() for i in infos], sort_keys=True))
        return EXIT_OK
    print(f"{'KEY':<16} {'SIZE':>10} {'DTYPE':<9} {'IN-USE':<6} {'LAST-USED':<20} CREATED")
    for i in infos:
        dtype = (i.identity or {}).get("dtype", "?")
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.last_used))
        note = f"  ({i.problem})" if i.problem else ""
        print(f"{i.key[:16]} {i.bytes / 2**30:>8.2f}Gi {dtype:<9} {'yes' if i.in_use else 'no':<6} "
              f"{used:<20} {i.created_at or '?'}{note}")
    return EXIT_OK


def _cmd_gc(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl.store import CacheStore

    report = CacheStore(root).gc(args.max_bytes, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for key in report.removed:
        print(f"{verb} {key}")
    for key in report.kept_in_use:
        print(f"kept   {key} (in use)")
    print(f"{report.bytes_before / 2**30:.2f} GiB -> {report.bytes_after / 2**30:.2f} GiB "
          f"(budget {args.max_bytes / 2**30:.2f} GiB)")
    return EXIT_OK


def _cmd_rm(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl.store import CacheStore

    store = CacheStore(root)
    rc = EXIT_OK
    for key in args.keys:
        if not store.exists(key):
            print(f"no entry {key}", file=sys.stderr)
            rc = EXIT_ERROR
        elif store.remove(key):
            print(f"removed {key}")
        else:
            print(f"entry {key} is in use or being built; not removed", file=sys.stderr)
            rc = EXIT_ERROR
    return rc


def _cmd_serve(root: Path, args: argparse.Namespace) -> int:
    from ditserve.cachectl import logs
    from ditserve.cachectl.daemon import DaemonConfig, serve

    config = DaemonConfig(root=root, socket_path=args.socket or default_socket(root),
                          tcp=args.tcp, metrics_port=args.metrics_port,
                          scrub_interval_s=args.scrub_interval,
                          scrub_rate_mib_s=args.scrub_rate_mib, max_builds=args.max_builds)
    serve(config, logs.setup())
    return EXIT_OK


_COMMANDS = {"build": _cmd_build, "ensure": _cmd_ensure, "verify": _cmd_verify,
             "list": _cmd_list, "gc": _cmd_gc, "rm": _cmd_rm, "serve": _cmd_serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = getattr(args, "root", None) or default_root()
    try:
        return _COMMANDS[args.command](root, args)
    except EntryCorruptError as e:
        print(f"cachectl: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except CacheError as e:
        print(f"cachectl: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
