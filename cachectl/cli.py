"""The ``cachectl`` command line: a thin shell over the store, the model builder and the daemon.

Subcommands: build, ensure, pull, verify, list, gc, rm, serve (``cachectl COMMAND --help``).
``--root`` is accepted before or after the subcommand; default ``$DITSERVE_CACHE_ROOT``, else
/var/cache/ditserve. Reading commands (verify, list, gc, rm) never create a root: a mistyped
one is an error, not an empty cache.

Exit status, distinct on purpose (scripts and the operator's init container read them):

    0    ok
    1    corruption found (verify; build/ensure meeting a corrupt entry)
    2    usage error (bad flags, a malformed key, gc without --max-bytes)
    3    missing or unavailable: no such cache or entry, an entry in use, unreadable or
         written by an older cachectl, a read-only root for a writing command, a timeout, a
         build or daemon failure
    130  interrupted (Ctrl-C); 141 stdout closed by its reader (``cachectl list | head -1``)

This module is one of the two edges that import the engine (lazily, in ``engine_loader``); the
daemon gets its loader from here. ``$DITSERVE_CACHECTL_LOADER=module:attr`` names another
ModelLoader (an out-of-tree loader, or the tests' light one).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ditserve.cachectl.commands import (
    ALL_COMPONENTS,
    COMMANDS,
    EXIT_CORRUPT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    LoaderFn,
    model_paths,
)
from ditserve.cachectl.errors import BuildError, CacheError, EntryCorruptError, UsageError
from ditserve.cachectl.identity import DTYPES
from ditserve.cachectl.layout import default_root
from ditserve.cachectl.model_build import ModelLoader
from ditserve.cachectl.pulled_gc import DEFAULT_PARTIAL_MAX_AGE_S

LOADER_ENV = "DITSERVE_CACHECTL_LOADER"
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141
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


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def engine_loader() -> ModelLoader:
    """The engine's DiT loader as a ModelLoader (or the one ``$DITSERVE_CACHECTL_LOADER`` names)."""
    spec = os.environ.get(LOADER_ENV)
    if spec:
        module_name, _, attr = spec.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), attr or "LOADER")
        except (ImportError, AttributeError) as e:
            raise BuildError(f"${LOADER_ENV}={spec!r} names no loader: {e}") from e
        return found() if callable(found) and not isinstance(found, ModelLoader) else found
    from ditserve.cachectl.model_build import describe_loader

    try:
        from ditserve.engine.weights import checkpoint_cache, loader
    except ImportError as e:  # pragma: no cover - only in a broken install
        raise BuildError(f"the engine loader is not importable: {e}") from e
    return describe_loader(loader, checkpoint_cache)


def default_dtype(model: Path, component: str, loader: LoaderFn) -> str:
    """``--dtype`` when omitted: the dtype the DiT is stored in (``st_format.stored_dtype``),
    the rule ``ditserve serve`` follows too, so both agree on the entry."""
    from ditserve.cachectl.model_build import require_model_dir
    from ditserve.cachectl.st_header import stored_dtype

    require_model_dir(model)
    if component == ALL_COMPONENTS:  # every DiT: the dtype of the model's first, as serve's
        component = "transformer"
    model_loader = loader()  # a loader that cannot be found says so itself, not as a dtype
    try:
        found = stored_dtype(list(model_loader.source_files(model.resolve(), component)))
    except Exception as e:  # the loader's own errors name what is wrong with the directory
        # (--dtype would not help: building reads the same files)
        raise BuildError(f"{str(model)!r} is not a usable model directory: {e}") from e
    if found is None:
        if os.environ.get(LOADER_ENV):
            # A loader named by $DITSERVE_CACHECTL_LOADER reads files the engine does not,
            # so there is no engine rule to agree with: bfloat16, the cache's own default.
            return "bfloat16"
        raise BuildError(f"{str(model)!r} has no float32/bfloat16/float16 safetensors weights "
                         "to take the dtype from; pass --dtype")
    return found


def _add_pull(sub: Any, common: argparse.ArgumentParser) -> None:
    """``cachectl pull``'s flags (docs/cachectl.md, "Pulling models")."""
    pl = sub.add_parser("pull", parents=[common],
                        help="download a model from hf:// or s3:// into the cache, once per node")
    pl.add_argument("uri", metavar="URI", help="hf://org/repo[@revision] or s3://bucket/prefix")
    pl.add_argument("--workers", type=_positive_int, default=8,
                    help="files downloaded at a time")
    pl.add_argument("--link", type=Path, default=None, metavar="PATH",
                    help="make PATH a symlink to the pulled model folder (an engine's --model)")
    pl.add_argument("--socket", type=Path, default=None,
                    help="daemon socket (default: $DITSERVE_CACHECTL_SOCKET or ROOT/cachectl.sock)")
    pl.add_argument("--timeout", type=float, default=6 * 3600.0,
                    help="seconds to wait: for the daemon's download, or (pulling here) for "
                         "another pull of the same model; a download this process runs "
                         "itself is not cut short")
    pl.add_argument("--json", action="store_true", help="print the result as JSON")
    pull_how = pl.add_mutually_exclusive_group()
    pull_how.add_argument("--no-daemon", action="store_true", help="never ask the daemon")
    pull_how.add_argument("--daemon-only", action="store_true",
                          help="only ask the daemon (wait for it up to --timeout), never write "
                               "the cache here: for pods that mount the cache read-only")


def model_args(sp: argparse.ArgumentParser) -> None:
    """The flags naming a model entry (build and ensure)."""
    sp.add_argument("--model", required=True, type=Path,
                    help="local diffusers model directory, or a DiT checkpoint file "
                         "(single-file, GGUF or FP8 safetensors) with --base-model")
    sp.add_argument("--base-model", type=Path, default=None, metavar="DIR",
                    help="with --model FILE: the diffusers directory of the file's family "
                         "it is served with (`ditserve serve --model FILE --base-model DIR`)")
    sp.add_argument("--dtype", choices=DTYPES, default=None,
                    help="runtime dtype (default: the dtype the DiT's weights are stored "
                         "in, as `ditserve serve` defaults)")
    sp.add_argument("--revision", default=None, help="revision label recorded in the identity")
    sp.add_argument("--component", default="transformer", metavar="NAME",
                    help="which DiT of the model (Wan 2.2's second expert: transformer_2; "
                         "'all': every DiT the model has, one entry each)")
    sp.add_argument("--sp-size", type=_positive_int, default=1,
                    help="sequence-parallel world size of the engines (part of the identity)")
    sp.add_argument("--sp-impl", default=None,
                    help="sequence-parallel implementation name (with --sp-size > 1)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="cache root (default: $DITSERVE_CACHE_ROOT or /var/cache/ditserve)")
    p = argparse.ArgumentParser(prog="cachectl", parents=[common],
                                description="Node-local runtime weight cache for ditserve.",
                                epilog="exit status: 0 ok, 1 corruption found, 2 usage error, "
                                       "3 missing or unavailable")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    how = e.add_mutually_exclusive_group()
    how.add_argument("--no-daemon", action="store_true", help="never ask the daemon")
    how.add_argument("--daemon-only", action="store_true",
                     help="only ask the daemon (wait for it up to --timeout), never write the "
                          "cache here: for pods that mount the cache read-only")

    _add_pull(sub, common)

    v = sub.add_parser("verify", parents=[common], help="re-hash entries; exit 1 on corruption")
    v.add_argument("keys", nargs="*", metavar="KEY", help="entries to check (default: all)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--threads", type=_positive_int, default=None,
                   help="hashing threads (default: the cores this process may use)")

    ls = sub.add_parser("list", parents=[common], help="list entries")
    ls.add_argument("--json", action="store_true")

    g = sub.add_parser("gc", parents=[common], help="remove unused entries, LRU first")
    g.add_argument("--max-bytes", type=parse_size, default=None, metavar="N",
                   help="required: keep at most N bytes (500M, 10G, ...; 0 removes every "
                        "entry no process uses)")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    g.add_argument("--partial-age", type=float, default=DEFAULT_PARTIAL_MAX_AGE_S, metavar="S",
                   help="remove .partial/<key> folders of interrupted pulls untouched for S "
                        "seconds (default a day; a pull retried sooner resumes there)")
    g.add_argument("--json", action="store_true")

    r = sub.add_parser("rm", parents=[common], help="remove entries now (refused while in use)")
    r.add_argument("keys", nargs="+", metavar="KEY")

    s = sub.add_parser("serve", parents=[common], help="run the node daemon")
    s.add_argument("--socket", type=Path, default=None)
    s.add_argument("--tcp", type=_tcp, default=None, metavar="HOST:PORT",
                   help="also serve the API on TCP")
    s.add_argument("--metrics-port", type=int, default=None, help="Prometheus port")
    s.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="address of the metrics port (default: $POD_IP, else 127.0.0.1)")
    s.add_argument("--scrub-interval", type=float, default=6 * 3600.0, metavar="S",
                   help="seconds between scrubs (0 disables)")
    s.add_argument("--scrub-rate-mib", type=float, default=256.0, metavar="MIB_S",
                   help="scrub read rate limit in MiB/s (0: unlimited)")
    s.add_argument("--max-builds", type=_positive_int, default=2, help="concurrent builds")
    s.add_argument("--grace-period", type=float, default=45.0, metavar="S",
                   help="on SIGTERM, seconds a running build may take to finish (keep below "
                        "the pod's terminationGracePeriodSeconds)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command == "gc" and args.max_bytes is None:
        parser.error("gc needs --max-bytes N: the size to shrink the cache to (500M, 10G, ...); "
                     "--max-bytes 0 removes every entry no process uses")
    root = getattr(args, "root", None) or default_root()
    try:
        if getattr(args, "model", None) is not None and args.dtype is None:
            # A checkpoint file is served in its base model's dtype, as `ditserve serve`
            # (model_paths first refuses a checkpoint file without its base model).
            model_dir, _ = model_paths(args)
            args.dtype = default_dtype(model_dir, args.component, engine_loader)
        rc = COMMANDS[args.command](root, args, engine_loader)
        sys.stdout.flush()  # a closed pipe must fail here, not in the interpreter's exit
        return rc
    except EntryCorruptError as e:
        print(f"cachectl: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except UsageError as e:
        print(f"cachectl: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CacheError as e:
        print(f"cachectl: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep the interpreter's final
        # flush of stdout from raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
