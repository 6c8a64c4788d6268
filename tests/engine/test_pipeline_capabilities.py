"""Optional pipeline capabilities (``engine.pipelines.capabilities``): what a pipeline declares
is read through its protocol, what it leaves out gets the default, and no engine module probes
the capabilities' attribute names with getattr/hasattr."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from ditserve.engine.families import FLUX
from ditserve.engine.pipelines import capabilities
from ditserve.engine.pipelines.capabilities import (
    BatchedConditions,
    BatchedPromptEncoder,
    cfg_rows_of,
    condition_images_of,
    decodes_in_batches,
    encoder_reads_images,
    host_modules_of,
    keeps_encoder_hidden_states,
    pixels_per_token_of,
    prompt_reads_images,
)
from ditserve.engine.step_cache.runtime import CachedBlockLists, RefusesStepCache

ENGINE = Path(__file__).resolve().parents[2] / "engine"
OPTIONAL = {"pixels_per_token", "cfg_rows", "condition_images", "encode_conditions",
            "host_modules", "_encode_prompt", "_encode_prompts", "text_prompts",
            "prompt_reads_images", "encoder_reads_images", "encoder_keeps_hidden_states",
            "batched_decode", "step_cache_refusal", "step_cache_block_lists"}


class _Plain:
    """A pipeline with nothing optional."""

    family = FLUX
    pixel_multiple = 16


class _Cosmos3Like(_Plain):
    pixels_per_token = 32
    cfg_rows = "guidance"
    condition_images = (0, 1)
    host_modules = (object(),)
    prompt_reads_images = True
    encoder_keeps_hidden_states = True
    batched_decode = False
    step_cache_refusal = "its blocks take no rows"
    step_cache_block_lists = ("layers",)

    def encode_conditions(self, states: object) -> None: ...


def test_a_pipeline_without_capabilities_gets_the_defaults() -> None:
    plain: object = _Plain()
    assert pixels_per_token_of(plain) == 16  # type: ignore[arg-type]
    assert cfg_rows_of(plain) == FLUX.cfg_rows  # type: ignore[arg-type]
    assert condition_images_of(plain) == (0, 0)
    assert tuple(host_modules_of(plain)) == ()
    assert not prompt_reads_images(plain) and not keeps_encoder_hidden_states(plain)
    assert not encoder_reads_images(plain)
    assert decodes_in_batches(plain)
    for protocol in (BatchedConditions, BatchedPromptEncoder, RefusesStepCache,
                     CachedBlockLists):
        assert not isinstance(plain, protocol)


def test_declared_capabilities_are_read_through_their_protocols() -> None:
    declared: object = _Cosmos3Like()
    assert pixels_per_token_of(declared) == 32  # type: ignore[arg-type]
    assert cfg_rows_of(declared) == "guidance"  # type: ignore[arg-type]
    assert condition_images_of(declared) == (0, 1)
    assert len(host_modules_of(declared)) == 1
    assert prompt_reads_images(declared) and keeps_encoder_hidden_states(declared)
    assert encoder_reads_images(declared)  # a prompt that reads images shows the encoder them
    assert encoder_reads_images(SimpleNamespace(encoder_reads_images=True))
    assert not decodes_in_batches(declared)
    for protocol in (BatchedConditions, RefusesStepCache, CachedBlockLists):
        assert isinstance(declared, protocol)


def test_instance_attributes_count_as_declared() -> None:
    # Families set some in __init__ (Z-Image's condition_images, FLUX.2 [klein]'s cfg_rows).
    pipeline = SimpleNamespace(family=FLUX, pixel_multiple=16, condition_images=(0, 1),
                               cfg_rows="true_cfg")
    assert condition_images_of(pipeline) == (0, 1)
    assert cfg_rows_of(pipeline) == "true_cfg"  # type: ignore[arg-type]


def _probes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in OPTIONAL):
            found.append(f"{path.relative_to(ENGINE)}:{node.lineno} {node.args[1].value}")
    return found


def test_no_engine_module_probes_an_optional_capability_by_name() -> None:
    probes = [probe for path in sorted(ENGINE.rglob("*.py"))
              if path.relative_to(ENGINE).parts[0] != "families"
              for probe in _probes(path)]
    assert probes == [], (f"declare a protocol in {capabilities.__name__} and ask isinstance "
                          f"instead: {probes}")
