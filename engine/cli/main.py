"""`ditserve` command line: generate, demo, serve, model init-tiny / init-random / convert.

A thin shell: parse flags, build an EngineConfig (engine.config.flags), call one library
function, print results. Heavy imports (torch, diffusers) happen inside the commands so
`ditserve --help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ditserve.engine.allocator import prefer_expandable_segments
from ditserve.engine.cli.convert import add_convert_parsers
from ditserve.engine.cli.demo import cmd_demo
from ditserve.engine.cli.generate import add_generate_parser
from ditserve.engine.config.flags import add_engine_options
from ditserve.engine.errors import DitServeError
from ditserve.engine.families import MODEL_VARIANTS
from ditserve.engine.server.options import add_server_options
from ditserve.engine.termination import record_fatal

log = logging.getLogger("ditserve")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_init_tiny(args: argparse.Namespace) -> int:
    from ditserve.engine.makers.tiny_model import init_tiny

    path = init_tiny(args.dir, family=args.family)
    print(f"wrote a tiny random-weight {args.family} pipeline to {path}")
    return 0


def cmd_init_random(args: argparse.Namespace) -> int:
    from ditserve.engine.makers.random_model import default_components, init_random

    components = args.components or default_components(args.size)
    path = init_random(args.dir, family=args.family, size=args.size, dtype=args.dtype,
                       device=args.device, seed=args.seed, components=components)
    around = ("every component at its released shape" if components == "all"
              else "tiny text encoders and VAE")
    print(f"wrote a random-weight {args.family} pipeline ({args.size} DiT, {around}, "
          f"{args.dtype}) to {path}")
    return 0


def cmd_ref2va(args: argparse.Namespace) -> int:
    from ditserve.engine.families.minimax_h3.references import write_ref2va_replica

    path = write_ref2va_replica(args.checkpoint, args.out)
    print(f"wrote the ref2va replica directory {path} (links into {args.checkpoint}; its DiT "
          "is the checkpoint's transformer_ref): serve it with --model")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """A rank > 0 of a replica whose processes were started by a launcher (e.g. a pod)."""
    from ditserve.engine.config import RunnerConfig
    from ditserve.engine.config.flags import engine_config_and_server_section
    from ditserve.engine.distributed.rendezvous import Rendezvous, worker_timeout_s
    from ditserve.engine.distributed.worker import worker_main
    from ditserve.engine.makers.tiny_model import ensure_tiny

    config, _ = engine_config_and_server_section(args)  # the server section is rank 0's
    rdv = Rendezvous.from_env()
    if rdv is None or rdv.rank == 0:
        raise DitServeError(
            "`ditserve worker` needs WORLD_SIZE > 1 and RANK >= 1 in the environment "
            "(with MASTER_ADDR/MASTER_PORT of rank 0, which runs `ditserve serve`)"
        )
    model_dir = config.model or str(ensure_tiny())
    # This rank's composition root: it resolves the offload as rank 0 does (same rules).
    worker_main(rdv.rank, rdv.world_size, rdv.master_addr, rdv.master_port,
                RunnerConfig.of(config), config.parallel, model_dir, worker_timeout_s(),
                rdv.local_rank)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ditserve.engine.server.main import serve_from_args

    return serve_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)

    demo = sub.add_parser("demo", help="run concurrent requests on the embedded tiny model")
    demo.add_argument("--out-dir", type=Path, default=Path("demo-out"))
    demo.add_argument("--size", type=int, default=64, help="image side in pixels")
    add_engine_options(demo, with_config_file=False)
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="serve the OpenAI-style HTTP API")
    add_engine_options(serve)
    add_server_options(serve)  # pure flags (server.options); uvicorn loads only to serve
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser(
        "worker", help="run rank RANK of a multi-process replica (environment rendezvous)")
    add_engine_options(worker)
    worker.set_defaults(func=cmd_worker)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("init-tiny",
                                help="write a tiny random-weight pipeline (default Flux) to DIR")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--family", choices=tuple(MODEL_VARIANTS), default="flux",
                      help="wan: Wan 2.1 T2V; wan2.2: Wan 2.2 T2V A14B (two experts); "
                           "wan2.2-ti2v: Wan 2.2 TI2V 5B")
    tiny.set_defaults(func=cmd_init_tiny)
    rnd = model_sub.add_parser(
        "init-random", help="write a random-weight pipeline at released shapes to DIR "
                            "(for benchmarks)")
    rnd.add_argument("dir", type=Path)
    rnd.add_argument("--family", choices=tuple(MODEL_VARIANTS), default="flux")
    rnd.add_argument("--size", choices=("tiny", "small", "full"), default="full",
                     help="full: the released DiT: Flux.1 (11.9B parameters, ~24 GB in "
                          "bfloat16), Qwen-Image (20B), Wan2.1-T2V-14B, Wan2.2-T2V-A14B (two "
                          "14B experts), Wan2.2-TI2V-5B, Z-Image (6.15B), Cosmos3-Nano (15.2B; cosmos3-super: "
                          "a Super-sized ~64B)")
    rnd.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    rnd.add_argument("--components", choices=("all", "dit"), default=None,
                     help="all (default with --size full): every text encoder, image "
                          "encoder and VAE at its released shape too (Flux: CLIP-L, T5-XXL, "
                          "its VAE; Qwen-Image: Qwen2.5-VL-7B; Wan: UMT5-XXL, the Wan VAE; "
                          "Z-Image: Qwen3-4B, Flux's VAE; Cosmos3: the Wan 2.2 VAE, its DiT reads tokens itself); "
                          "dit (default otherwise): the DiT at --size with tiny text encoders "
                          "and VAE, for quick runs")
    rnd.add_argument("--device", default="auto",
                     help="where to allocate and initialize the modules (auto: cuda if "
                          "present; a GPU builds a full pipeline in seconds); each is "
                          "written and freed before the next is built, so it needs room "
                          "for the largest component, not the whole pipeline")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.set_defaults(func=cmd_init_random)
    ref2va = model_sub.add_parser(
        "ref2va", help="write the model directory of a MiniMax-H3 ref2va replica (the "
                       "omni-reference workflow: the checkpoint's transformer_ref as its DiT; "
                       "links, no copies) to OUT")
    ref2va.add_argument("checkpoint", type=Path, help="a MiniMax-H3 directory with "
                                                      "transformer_ref")
    ref2va.add_argument("out", type=Path, help="a new directory")
    ref2va.set_defaults(func=cmd_ref2va)
    add_convert_parsers(model_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    if prefer_expandable_segments():
        log.debug("CUDA allocator: %s (PYTORCH_CUDA_ALLOC_CONF was unset)",
                  os.environ["PYTORCH_CUDA_ALLOC_CONF"])
    try:
        return int(args.func(args))
    except DitServeError as e:
        print(f"error: {e}", file=sys.stderr)
        record_fatal(f"error: {e}")  # a pod's status shows it (engine.termination)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
