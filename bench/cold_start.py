#!/usr/bin/env python3
"""Time to ready: process start to ``/ready`` of ``ditserve serve``, with its start phases and
the floor of reading the model's bytes once.

Each variant starts a fresh server process (one at a time), polls ``/ready`` from the moment
the process was spawned, then reads the engine's own account of its start from ``/metrics``
(``ditserve:start_phase_seconds{phase}``, ``ditserve:start_to_ready_seconds``) and stops it.
The floor is what no start can beat: reading every file of the model directory once, timed
here first (from the page cache when the model is warm there: run the bench twice, or ``cat``
the model to /dev/null first, as the targets assume). With ``--image-check``, each started
server then makes one image (fixed prompt, seed and size, a few steps) and the table compares
it with the first variant's and with the start before it, pixel by pixel (the JSON keeps each
image's digest): issue 50 asks that a replica started from compiled artifacts serves the same
images as the replica that compiled them. Variants:

    dlo         --offload dlo
    resident    --offload none
    compile     --offload dlo --compile, twice on a fresh node cache root: the first start
                compiles and saves the artifacts, the second ("compile-2nd") loads them

    python3 bench/cold_start.py --model /models/flux1-dev --variants dlo resident compile

Prints one table (seconds); ``--out`` writes JSON beside it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import numpy as np
from job_processes import answers, free_port, running, wait_until
from PIL import Image

PHASES = ("process", "cuda_init", "imports", "read", "place", "pin_register", "encoders",
          "warm_up", "compile", "load")
VARIANTS = {"dlo": ["--offload", "dlo"], "resident": ["--offload", "none"],
            "compile": ["--offload", "dlo", "--compile"]}


def read_floor(model: Path, chunk: int = 64 << 20) -> dict[str, float]:
    """Seconds to read every byte of the model directory once (large sequential reads)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9}


def start_once(args: argparse.Namespace, flags: list[str], env: dict[str, str],
               log_path: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [*shlex.split(args.server_cmd), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(args.model), *flags, *shlex.split(args.serve_args)]
    harness.log(f"launching: {shlex.join(cmd)}")
    url = f"http://127.0.0.1:{port}"
    with running(cmd, log_path, env=env) as (process, spawned):
        wall = wait_until(lambda: answers(f"{url}/ready"), process, spawned, args.timeout,
                          log_path, every_s=0.05)
        samples = harness.scrape_metrics(url)
        image = make_image(url, args.image_size, args.timeout) if args.image_check else None
    phases = {name: samples.get(f'ditserve:start_phase_seconds{{phase="{name}"}}')
              for name in PHASES}
    result = {"ready_s": wall, "engine_ready_s": samples.get("ditserve:start_to_ready_seconds"),
              "phases": {k: v for k, v in phases.items() if v is not None}}
    if image is not None:
        result["image"] = image
    return result


def make_image(url: str, size: str, timeout_s: float) -> np.ndarray:
    """One image from the server: the same prompt, seed, size and steps for every variant."""
    response = httpx.post(f"{url}/v1/images/generations", timeout=timeout_s, json={
        "prompt": "a lighthouse on a cliff at dawn", "size": size, "seed": 7,
        "num_inference_steps": 4, "response_format": "b64_json"})
    response.raise_for_status()
    b64 = response.json()["data"][0]["b64_json"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def image_verdict(image: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    """How one variant's image compares with the first variant's (0-255 pixel values)."""
    if image.shape != reference.shape:
        return {"same": False, "max_diff": None, "sha256": pixels_digest(image)}
    diff = np.abs(image.astype(np.int16) - reference.astype(np.int16))
    return {"same": bool(diff.max() == 0), "max_diff": int(diff.max()),
            "mean_diff": float(diff.mean()), "sha256": pixels_digest(image)}


def pixels_digest(image: np.ndarray) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def compare_images(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """Each row's image replaced by its verdict against the first row's image; each row after
    the first also gets ``image_vs_previous``, its verdict against the row before it (so
    ``compile-2nd`` is compared with ``compile``, not only with the uncompiled start)."""
    made = [r for _, r in rows if "image" in r]
    images = [r["image"] for r in made]
    for i, r in enumerate(made):
        r["image"] = image_verdict(images[i], images[0])
        if i:
            r["image_vs_previous"] = image_verdict(images[i], images[i - 1])


def image_cell(verdict: dict[str, Any] | None) -> str:
    if verdict is None:
        return "-"
    if verdict["same"]:
        return "same"
    return "other size" if verdict["max_diff"] is None else f"max diff {verdict['max_diff']}"


def table(rows: list[tuple[str, dict[str, Any]]], floor: dict[str, float]) -> str:
    shown = [p for p in PHASES if any(p in r["phases"] for _, r in rows)]
    checked = any("image" in r for _, r in rows)
    head = ["variant", "ready", *shown, "floor", "ready/floor",
            *(["image vs first", "vs previous"] if checked else [])]
    body = []
    for name, r in rows:
        body.append([name, f"{r['ready_s']:.2f}",
                     *(f"{r['phases'][p]:.2f}" if p in r["phases"] else "-" for p in shown),
                     f"{floor['seconds']:.2f}", f"{r['ready_s'] / floor['seconds']:.1f}x",
                     *([image_cell(r.get("image")), image_cell(r.get("image_vs_previous"))]
                       if checked else [])])
    return "\n".join(harness.md_table(head, body))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="diffusers model directory")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["dlo", "resident"])
    p.add_argument("--server-cmd", default=f"{sys.executable} -m ditserve.engine.cli")
    p.add_argument("--serve-args", default="", help="more `ditserve serve` flags")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to ready, per start")
    p.add_argument("--image-check", action="store_true",
                   help="make one image on each started server and compare it with the first's")
    p.add_argument("--image-size", default="512x512", help="that image's WxH")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    floor = read_floor(a.model)
    harness.log(f"floor: {floor['bytes'] / 2**30:.1f} GiB read once in {floor['seconds']:.2f}s "
                f"({floor['gb_per_s']:.1f} GB/s)")
    logs = Path(tempfile.mkdtemp(prefix="cold-start-"))
    rows: list[tuple[str, dict[str, Any]]] = []
    for variant in a.variants:
        env = dict(os.environ)
        runs = [variant]
        if variant == "compile":
            # A fresh node cache: the first start compiles and saves, the second loads.
            root = logs / "cache"
            (root / "v1").mkdir(parents=True, exist_ok=True)
            env["DITSERVE_CACHE_ROOT"] = str(root)
            runs = ["compile", "compile-2nd"]
        for run in runs:
            rows.append((run, start_once(a, VARIANTS[variant], env, logs / f"{run}.log")))
            harness.log(f"{run}: ready in {rows[-1][1]['ready_s']:.2f}s")
    compare_images(rows)
    print(table(rows, floor))
    if a.out is not None:
        a.out.write_text(json.dumps({"floor": floor, "runs": dict(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
