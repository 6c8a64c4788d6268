"""The defaults of a diffusers pipeline's ``__call__``: what a default diffusers call uses.

ditserve's request defaults (``server.model_defaults``, ``ditserve generate``) and each
step-wise pipeline's text length read them here instead of keeping copies, so a request that
leaves guidance, CFG or text length out runs what the same default diffusers call runs.

Given the module that defines the class (a family's ``pipeline_module``), the defaults are read
from that module's source (``ast``), without importing it: importing any diffusers pipeline
imports torch._dynamo, every DiT and VAE class of diffusers, transformers and the LoRA
machinery (about 4 s of a start, issue 50), and ``ditserve serve`` needs its request defaults
before the engine loads the model, so the server's defaults must not wait for those imports.
Where the source does not say (no such file or class, a ``__call__`` it inherits, a default
that is not a literal), and without a module, the imported class's signature answers.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any


@functools.cache
def call_defaults(pipeline_class: str, module: str | None = None) -> Mapping[str, Any]:
    """The defaults of a diffusers pipeline's ``__call__`` by argument name (``guidance_scale``,
    ``true_cfg_scale``, ``max_sequence_length``, ``num_inference_steps``, ...): what a default
    diffusers call uses, so ditserve's defaults are the pipeline's own, not copies of them.

    module: the dotted name of the diffusers module that defines ``pipeline_class``; given,
    the source answers without importing diffusers where it can (see the module docstring).
    """
    if module is not None:
        found = source_call_defaults(pipeline_class, module)
        if found is not None:
            return MappingProxyType(found)
    return MappingProxyType(signature_call_defaults(pipeline_class))


def signature_call_defaults(pipeline_class: str) -> dict[str, Any]:
    """The defaults from the imported class's ``__call__`` signature (imports diffusers)."""
    import inspect

    import diffusers

    signature = inspect.signature(getattr(diffusers, pipeline_class).__call__)
    return {name: parameter.default for name, parameter in signature.parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def source_call_defaults(pipeline_class: str, module: str) -> dict[str, Any] | None:
    """The defaults as ``module``'s source spells them, or None where it cannot tell: the
    file or the class is missing, the class inherits its ``__call__``, or a default is not a
    literal (``ast.literal_eval``) or arithmetic on literal numbers. Finds the file from the top-level package's location, so
    nothing of the package is imported."""
    path = _source_file(module)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    call = _call_method(tree, pipeline_class)
    if call is None:
        return None
    args = call.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults,
                     strict=True))
    pairs += [(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults,
                                                     strict=True) if default is not None]
    defaults = {}
    for arg, default in pairs:
        try:
            defaults[arg.arg] = _constant(default)
        except ValueError:  # a name or a call: only the imported signature knows its value
            return None
    return defaults


# Spelled out, not the ``operator`` module: the repository's ``operator`` folder shadows it
# for the type checker.
_ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b,
    ast.Pow: lambda a, b: a**b,
}


def _constant(node: ast.expr) -> Any:
    """A literal (``ast.literal_eval``), or arithmetic on numbers (Flux Kontext's
    ``max_area: int = 1024**2``); ValueError for anything else."""
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _constant(node.left), _constant(node.right)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   for v in (left, right)):
            raise ValueError("arithmetic on something other than numbers")
        return _ARITHMETIC[type(node.op)](left, right)
    return ast.literal_eval(node)


def _source_file(module: str) -> Path | None:
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location, *rest).with_suffix(".py")
        if path.is_file():
            return path
    return None


def _call_method(tree: ast.Module, class_name: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__call__":
                    return item
            return None  # inherited: the signature must answer
    return None
