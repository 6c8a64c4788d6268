"""The `ditserve-operator` command: runs the kopf operator with the project's settings.

Owns the command line (namespaces or cluster-wide, liveness port, verbosity). Settings
themselves live in ``deployments.configure`` so `kopf run -m ditserve.operator.handlers`
behaves the same way.
"""

from __future__ import annotations

import argparse

import kopf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ditserve-operator",
        description="Reconcile DiffusionDeployment objects into engine pods.")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness-port", type=int, default=8080,
                        help="port of the liveness endpoint GET /healthz (0 disables it)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every API call")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Importing the module registers the handlers in kopf's default registry.
    from ditserve.operator import handlers  # noqa: F401

    kopf.configure(verbose=args.verbose)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
