"""Regional compilation: torch.compile each repeated DiT block's forward, not the whole model.

A DiT is dozens of copies of one or two block classes. Compiling the blocks' ``forward``
(rather than the model) costs one graph per block class: the blocks share their code, and
dynamo treats each block's parameters as graph inputs, so the graph compiled for the first
block serves every other one. The same property keeps layerwise offload compatible: its hooks
repoint a streamed block's parameters into a device slot before each call, and to dynamo that
is just another input with the same shape, dtype and strides (no recompile). The hooks
themselves (stream ordering, slot bookkeeping) run in ``Module.__call__`` around the compiled
``forward``, never inside it. That is why this is not diffusers' own
``ModelMixin.compile_repeated_blocks``: it calls ``Module.compile``, which compiles
``__call__`` with its hooks, and would trace DLO's stream waits and pointer swaps.

Shapes: the batch (rows) and the token count change between steps and requests. Dynamo
compiles the first shape statically and, at the first change, one graph with those sizes
dynamic; each of these compiles happens on the first step that needs it. Past dynamo's
recompile limit a block runs eagerly (correct, just not compiled).
"""

from __future__ import annotations

import logging
import os
import shutil

import torch
from torch import nn

from ditserve.engine.errors import ConfigError

log = logging.getLogger(__name__)


def require_toolchain(backend: str, device: torch.device) -> None:
    """Refuse ``--compile inductor`` where inductor would fail on its first compile.

    Inductor's GPU kernels are Triton's, and Triton builds each kernel's launcher with the host
    C compiler; its CPU kernels are C++. CUDA *runtime* container images (the official PyTorch
    ones among them) ship neither, and without this check the failure would surface only in the
    warm-up, after the weights were loaded. Called before loading.
    """
    if backend != "inductor":
        return
    if device.type == "cuda":
        names, env = ("cc", "gcc", "clang"), "CC"
        what = "a C compiler (Triton builds its kernel launchers with it)"
    else:
        names, env = ("c++", "g++", "clang++"), "CXX"
        what = "a C++ compiler (inductor's CPU kernels are C++)"
    candidates = [os.environ.get(env) or "", *names]
    if any(c and shutil.which(c) for c in candidates):
        return
    raise ConfigError(
        f"--compile inductor on {device.type} needs {what}, and none of {env}, "
        f"{', '.join(names)} is on PATH: install gcc/g++ (the ditserve image has it), set {env}, "
        "or run without --compile"
    )


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Every block of a class the model lists in ``_repeated_blocks`` (diffusers' declaration
    of its repeated block classes; Flux: its double- and single-stream blocks), in module
    order; empty when it declares none."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def compile_repeated_blocks(model: nn.Module, backend: str) -> int:
    """Compile the forward of every block of ``repeated_blocks``; how many were compiled."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ConfigError(
            f"--compile: {type(model).__name__} does not declare its repeated blocks "
            "(diffusers' _repeated_blocks); run it without --compile"
        )
    turn_off_caching_precompile()
    for block in blocks:
        # An instance attribute shadows the class's forward; Module.__call__ (and with it
        # every hook) stays eager.
        block.forward = torch.compile(block.forward, backend=backend)  # type: ignore[method-assign]
    log.info("compiling %d repeated blocks (%s) with the %s backend on first use",
             len(blocks), ", ".join(sorted({type(b).__name__ for b in blocks})), backend)
    return len(blocks)


def turn_off_caching_precompile() -> None:
    """Undo ``TORCH_CACHING_PRECOMPILE=1`` before the blocks are wrapped (the wrappers read it).

    With it, torch 2.13 saves Dynamo's traced code beside the compiled artifacts and a second
    replica installs it instead of tracing - and then fails its warm-up as soon as one shape
    still needs a trace ("Name '__builtins_dict___0' already exists in scope": the installed
    code and the new trace claim the same name in the blocks' module). Measured on the CPU
    with the tiny Flux (docs/benchmarks.md "Start to ready"): a replica that cannot start is
    worse than one that traces for a few seconds."""
    import torch._dynamo

    if getattr(torch._dynamo.config, "caching_precompile", False):
        log.warning("--compile: ignoring TORCH_CACHING_PRECOMPILE=1: with regional compilation "
                    "torch's caching precompile makes a second replica's warm-up fail")
        torch._dynamo.config.caching_precompile = False
