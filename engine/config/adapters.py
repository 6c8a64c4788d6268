"""``AdapterConfig``: the LoRA options of an engine, and the flag syntax that fills them.

Pure (no torch): ``engine.config`` nests it as ``EngineConfig.adapters``, the CLI parses
``--lora-modules NAME=PATH`` and ``--lora NAME=PATH[:SCALE]`` with ``parse_lora_module`` /
``parse_lora_arg``, the operator renders the same flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.engine.errors import ConfigError

# An adapter name is what a client sends as `model` or `loras[].name`: keep it URL- and
# shell-safe, and unlike a path.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 256


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA adapters served by one replica.

    lora_modules: adapter name -> local file (a .safetensors, or a directory holding one),
        loaded at start; more can be loaded at run time (``POST /v1/load_lora_adapter``).
    max_loras: adapters kept resident on the device at once; others are loaded on demand and
        the least recently used idle one is evicted. Adapters of running requests stay.
    max_lora_rank: the largest rank an adapter may have (a file beyond it is refused).
    fuse: merge the one adapter of ``lora_modules`` into the DiT's weights at start (a
        replica that serves one adapter only: no per-step cost); requests then get it
        always, and cannot choose another.
    """

    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    fuse: bool = False


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ConfigError(f"adapter name {name!r} must be 1-128 letters, digits, '.', '_' or "
                          "'-', starting with a letter or digit")
    return name


def adapter_problems(config: AdapterConfig) -> list[str]:
    """Every rule the adapter options break, as messages saying how to fix them."""
    out: list[str] = []
    modules = config.lora_modules
    if not isinstance(modules, dict):
        return [f"adapters.lora_modules must map names to paths, got {type(modules).__name__}"]
    for name, path in modules.items():
        try:
            check_name(name)
        except ConfigError as e:
            out.append(f"adapters.lora_modules: {e}")
        if not isinstance(path, str) or not path:
            out.append(f"adapters.lora_modules[{name!r}] must be a non-empty path")
    for key in ("max_loras", "max_lora_rank"):
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(f"adapters.{key} must be an integer >= 1, got {value!r}")
    if config.fuse and len(modules) != 1:
        out.append(f"adapters.fuse (--lora-fuse) merges exactly one adapter into the weights; "
                   f"lora_modules names {len(modules)}")
    return out


def parse_lora_module(text: str, flag: str = "--lora-modules",
                      form: str = "NAME=PATH") -> tuple[str, str]:
    """``NAME=PATH`` (``--lora-modules``) -> (name, path); ``flag``/``form``: how the error
    names the option the user typed."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ConfigError(f"{flag} takes {form}, got {text!r}")
    return check_name(name), path


def parse_lora_arg(text: str) -> tuple[str, str, float]:
    """``NAME=PATH[:SCALE]`` (``generate --lora``) -> (name, path, scale). A trailing
    ``:number`` is the scale; any other colon belongs to the path."""
    name, path = parse_lora_module(text, "--lora", "NAME=PATH[:SCALE]")
    scale = 1.0
    head, sep, tail = path.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
            path = head
        except ValueError:
            # A path may hold a colon; a mistyped scale after an existing file is an error
            # (not "no such file" for the file and the typo together).
            if "/" not in tail and not Path(path).exists() and Path(head).exists():
                raise ConfigError(f"--lora {text!r}: the scale after the last ':' must be a "
                                  f"number, got {tail!r}") from None
    return name, path, scale


def modules_mapping(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Flag values as ``lora_modules``; a name given twice is an error."""
    out: dict[str, Any] = {}
    for name, path in pairs:
        if name in out:
            raise ConfigError(f"adapter {name!r} is given twice in --lora-modules")
        out[name] = path
    return out
