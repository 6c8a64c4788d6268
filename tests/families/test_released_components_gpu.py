"""`init-random --components all` on CUDA (run on the device machine): the released T5-XXL,
CLIP-L and Flux VAE around a small Flux DiT are built on the GPU and written from there, with
the host holding far less than the pipeline's bytes and the GPU about the largest
component's; the directory loads under DLO with the blocks streamed from the checkpoint
mapping, no private copy, and the released encoders' shapes in their config.json."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.makers.builders import released_shapes
from ditserve.engine.makers.random_model import init_random
from ditserve.engine.offload.accounting import host_accounting
from ditserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


def _rss() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_released_flux_parts_build_on_the_gpu_and_load(tmp_path: Path) -> None:
    torch.zeros(1, device="cuda")  # the CUDA context's host memory is not the build's
    before, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    torch.cuda.reset_peak_memory_stats()
    try:
        model = init_random(tmp_path / "flux", family="flux", size="small", components="all",
                            device="cuda")
    finally:
        done.set()
        sampler.join()
    torch.cuda.empty_cache()
    marker = json.loads((model / ".ditserve-random-complete").read_text())
    total = 2 * sum(marker["parameters"].values())  # bf16 bytes of the whole pipeline
    assert total > 10e9  # T5-XXL's encoder alone is 9.5 GB
    # Built on the device and written a shard at a time: the host never held the pipeline.
    assert peak[0] - before < 0.75 * total, (peak[0] - before, total)
    # Written a component at a time, each freed before the next is built: the GPU held about
    # the largest (T5-XXL's 9.5 GB), never the whole pipeline.
    largest = 2 * max(marker["parameters"].values())
    hbm = torch.cuda.max_memory_allocated()
    assert hbm < 1.1 * largest < total, (hbm, largest, total)
    t5 = json.loads((model / "text_encoder_2" / "config.json").read_text())
    wanted = released_shapes("flux")["text_encoder_2"].config
    assert (t5["d_model"], t5["num_layers"], t5["d_ff"]) == (
        wanted["d_model"], wanted["num_layers"], wanted["d_ff"])

    # Served in the checkpoint's own dtype (EngineConfig's default is float32, which would
    # convert - and so copy - every streamed tensor) and with the mapping registered (on CUDA
    # checkpoint mmap needs --dlo-pin-limit-gib: an unregistered mapping streams at half the
    # rate, so auto keeps private pinned memory), the blocks stream from the mapping.
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                                                      offload=OffloadConfig(enabled=True,
                                                                            pin_limit_gib=64))),
                         model_dir=model)
    try:
        accounting = host_accounting(runner.offload.snapshot())
    finally:
        runner.close()
    assert accounting.ok, accounting.problems
    assert accounting.private_bytes == 0 and accounting.mapped_bytes > 0
