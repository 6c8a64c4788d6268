"""Compiled artifacts through the node cache: the key separates what must not be shared, a
second process loads what the first compiled (inductor on CPU, each process with its own
inductor cache dir, so only the node cache can explain the hit), and a read-only cache hands
them to the daemon."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from ditserve.cachectl.daemon import Daemon, DaemonConfig, create_app
from ditserve.engine.runner.compile_cache import (
    CompileKey,
    block_structure,
    load,
    model_fingerprint,
)

CHILD = Path(__file__).with_name("compile_cache_child.py")
KEY = CompileKey(model="m", shapes=((1024, 1024, 1), (1024, 1024, 2)), backend="inductor",
                 dtype="bfloat16", offload=True, sp_size=1, torch_version="2.13.0",
                 device="cuda:NVIDIA H200")


def test_the_key_changes_with_what_makes_artifacts_unshareable() -> None:
    assert KEY.digest == dataclasses.replace(KEY).digest
    for change in ({"model": "other"}, {"shapes": ((1024, 1024, 1),)}, {"backend": "aot_eager"},
                   {"torch_version": "2.14.0"}, {"device": "cuda:NVIDIA H100 80GB HBM3"},
                   {"offload": False}, {"sp_size": 2}, {"dtype": "float16"},
                   {"blocks": "f" * 64}):
        assert dataclasses.replace(KEY, **change).digest != KEY.digest, change


class _Processor:
    def __call__(self, *args: object) -> None: ...


class _OtherProcessor(_Processor): ...


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(4, 4)
        self.processor: _Processor = _Processor()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.ff = torch.nn.Linear(4, 4)


class _DiT(torch.nn.Module):
    _repeated_blocks = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(4, 4)


def test_the_block_structure_names_what_dropped_precompile_guards_assumed() -> None:
    first = block_structure(_DiT())
    assert block_structure(_DiT()) == first  # weights and instances do not matter
    outside = _DiT()
    outside.head = torch.nn.Identity()  # not a compiled block
    assert block_structure(outside) == first
    swapped = _DiT()
    swapped.blocks[0].ff = torch.nn.Identity()  # e.g. an FP8 or GGUF linear, a LoRA wrapper
    assert block_structure(swapped) != first
    processor = _DiT()
    processor.blocks[0].attn.processor = _OtherProcessor()  # SP's or a family's processor
    assert block_structure(processor) != first


def test_the_model_fingerprint_follows_the_dit_config_and_files(tmp_path: Path) -> None:
    dit = tmp_path / "transformer"
    dit.mkdir()
    (dit / "config.json").write_text('{"num_layers": 19}')
    (dit / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 10)
    first = model_fingerprint(tmp_path)
    (tmp_path / "vae").mkdir()  # other components do not change the DiT's graphs
    assert model_fingerprint(tmp_path) == first
    (dit / "config.json").write_text('{"num_layers": 57}')
    assert model_fingerprint(tmp_path) != first


def test_missing_or_foreign_artifacts_mean_compiling(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert load(tmp_path, KEY) is False
    path = tmp_path / "v1" / "compile" / f"{KEY.digest}.bin"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a mega-cache")
    with caplog.at_level(logging.WARNING):
        assert load(tmp_path, KEY) is False
    assert "do not load" in caplog.text


def test_the_daemon_publishes_artifacts_for_read_only_pods(tmp_path: Path) -> None:
    from cachectl_support import LIGHT_LOADER

    config = DaemonConfig(root=tmp_path / "cache", socket_path=tmp_path / "s.sock",
                          scrub_interval_s=0)
    daemon = Daemon(config, logging.getLogger("test"), LIGHT_LOADER)
    try:
        client = TestClient(create_app(daemon))
        ok = client.put(f"/v1/compile/{KEY.digest}", content=b"artifacts")
        assert ok.status_code == 200
        stored = Path(ok.json()["path"])
        assert stored.read_bytes() == b"artifacts"
        assert stored.stat().st_mode & 0o222 == 0  # published read-only
        assert client.put("/v1/compile/nope", content=b"x").status_code == 400
        assert client.put(f"/v1/compile/{KEY.digest}", content=b"").status_code == 413
    finally:
        daemon.stop()


def _child(mode: str, root: Path, inductor_dir: Path, device: str = "cpu") -> dict[str, object]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(CHILD), mode, str(root), device], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "v1").mkdir(parents=True)
    first = _child("save", root, tmp_path / "inductor-1")
    assert first == {"loaded": False, "saved": True, "hits": 0, "misses": 1}
    second = _child("load", root, tmp_path / "inductor-2")
    assert second == {"loaded": True, "saved": False, "hits": 1, "misses": 0}


@pytest.mark.gpu
def test_a_second_process_loads_what_the_first_compiled_on_the_gpu(tmp_path: Path) -> None:
    """The same on CUDA (Triton kernels, keyed by the GPU's name)."""
    root = tmp_path / "cache"
    (root / "v1").mkdir(parents=True)
    first = _child("save", root, tmp_path / "inductor-1", "cuda")
    assert first == {"loaded": False, "saved": True, "hits": 0, "misses": 1}
    second = _child("load", root, tmp_path / "inductor-2", "cuda")
    assert second == {"loaded": True, "saved": False, "hits": 1, "misses": 0}


def test_the_replicas_key_names_its_compiled_blocks(tmp_path: Path) -> None:
    """What the engine's start keys the node cache's artifacts with (``loop.startup``)."""
    from types import SimpleNamespace

    from ditserve.engine.config.resolved_offload import ResolvedOffload
    from ditserve.engine.loop.startup import WarmUp, _shared_compiles

    root = tmp_path / "cache"
    (root / "v1").mkdir(parents=True)
    dit = _DiT()
    runner = SimpleNamespace(pixel_multiple=16, device=torch.device("cpu"),
                             pipeline=SimpleNamespace(transformer=dit))
    shared = _shared_compiles(SimpleNamespace(runner=runner), WarmUp(compile_size=(64, 64)),
                              tmp_path, backend="inductor", dtype="bfloat16",
                              offload=ResolvedOffload(cache_root=str(root)), max_num_seqs=4,
                              sp_size=1)
    assert shared is not None and shared.root == root
    assert shared.key.blocks == block_structure(dit)
    assert shared.key.shapes == ((32, 32, 1), (64, 64, 1), (64, 64, 2))


def test_compiling_the_blocks_turns_torchs_caching_precompile_off(
        caplog: pytest.LogCaptureFixture) -> None:
    """TORCH_CACHING_PRECOMPILE=1 made a second replica's warm-up fail (a name clash in the
    blocks' module between installed and newly traced code): --compile undoes it, saying so."""
    import torch._dynamo

    from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

    dit = _DiT()
    # torch's own patch (monkeypatch's undo would delete the option, which hides it for good)
    with torch._dynamo.config.patch(caching_precompile=True), caplog.at_level(logging.WARNING):
        assert compile_repeated_blocks(dit, "eager") == 2
        assert torch._dynamo.config.caching_precompile is False
    assert "ignoring TORCH_CACHING_PRECOMPILE=1" in caplog.text
