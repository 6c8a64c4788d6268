"""A rank's runner takes its own part of the config (``engine.config.runner``): what
``RunnerConfig.of`` cuts from a replica's config, and that nothing below the cut takes the
root ``EngineConfig``."""

from __future__ import annotations

import ast
import pickle
from dataclasses import fields
from pathlib import Path

from ditserve.engine.config import (
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    ResolvedOffload,
    RunnerConfig,
    SchedulerConfig,
    StepCacheConfig,
)
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.config.judged import judged, remember_judged_offload

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# Below the cut: the step execution, the placement of the pipeline, the per-step data, the
# scheduling, and the executors and workers that start the ranks. They take sub-configs
# (RunnerConfig, SchedulerConfig, ParallelConfig, the ResolvedOffload, ...), never the root.
BELOW_THE_CUT = ("runner", "placement", "step", "sched", "distributed", "executor.py")
# Functions there that may still take the root config, by "path::qualified name". None: the
# roots that do (DiffusionEngine, loop.startup.open_executor, `ditserve worker`) sit above
# the cut and hand down RunnerConfig.of(config); a spawned worker receives that, pickled.
ALLOWED_ROOTS: set[str] = set()


def test_the_runner_takes_its_part_of_the_config() -> None:
    config = EngineConfig(
        model="/models/flux", checkpoint="/models/dit.gguf", dtype="bfloat16", device="cuda:1",
        compile="aot_eager", quantization="fp8",
        parallel=ParallelConfig(data_parallel_size=2, sequence_parallel_size=2),
        scheduler=SchedulerConfig(max_num_seqs=3), pipeline=PipelineConfig(prompt_cache_gib=2.0),
        adapters=AdapterConfig(max_loras=2), step_cache=StepCacheConfig(policy="every", every=2))
    resolved = ResolvedOffload(mode="local")
    runner = RunnerConfig.of(config, offload=resolved)
    assert runner == RunnerConfig(
        dtype="bfloat16", device="cuda:1", checkpoint="/models/dit.gguf", compile="aot_eager",
        quantization="fp8", sequence_parallel_size=2, offload=resolved,
        scheduler=SchedulerConfig(max_num_seqs=3), pipeline=PipelineConfig(prompt_cache_gib=2.0),
        adapters=AdapterConfig(max_loras=2), step_cache=StepCacheConfig(policy="every", every=2))
    # Every field the runner has is one the root config has (the cut only narrows).
    root_fields = {f.name for f in fields(EngineConfig)} | {"sequence_parallel_size"}
    assert {f.name for f in fields(RunnerConfig)} <= root_fields


def test_a_runner_on_its_own_resolves_its_offload_by_the_engines_rules() -> None:
    config = EngineConfig(offload=OffloadConfig(enabled=True),
                          parallel=ParallelConfig(data_parallel_size=2))
    assert RunnerConfig.of(config).offload == ResolvedOffload.of(config.offload,
                                                                 parallel=config.parallel)
    assert RunnerConfig.of(config).offload.mode == "allgather"
    assert RunnerConfig.of(EngineConfig()).offload == ResolvedOffload()


def test_a_worker_remembers_the_offload_options_rank_0_judged() -> None:
    config = EngineConfig.from_mapping({"offload": {"enabled": True}})
    sent = RunnerConfig.of(config)
    assert judged(sent.offload.options)  # rank 0's own: the judged config's options
    received = pickle.loads(pickle.dumps(sent))  # what a spawned worker gets
    assert received == sent and not judged(received.offload.options)
    remember_judged_offload(received.offload.options)
    assert judged(received.offload.options)


def _names_engine_config(annotation: ast.expr | None) -> bool:
    """An annotation naming ``EngineConfig`` (bare, dotted, quoted or inside a union)."""
    if annotation is None:
        return False
    return "EngineConfig" in ast.unparse(annotation)


def _root_config_takers(path: Path) -> list[str]:
    """``qualified name`` of each function in ``path`` with a parameter typed
    ``EngineConfig``, and ``import`` for each import of it."""
    found: list[str] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{scope}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                every = [*args.posonlyargs, *args.args, *args.kwonlyargs,
                         *(a for a in (args.vararg, args.kwarg) if a is not None)]
                if any(_names_engine_config(a.annotation) for a in every):
                    found.append(f"{scope}{child.name}")
                visit(child, f"{scope}{child.name}.")
            elif isinstance(child, ast.ImportFrom):
                if any(alias.name == "EngineConfig" for alias in child.names):
                    found.append("import")
            else:
                visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def _below_the_cut() -> list[Path]:
    paths: list[Path] = []
    for name in BELOW_THE_CUT:
        target = ENGINE / name
        paths.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return paths


def test_the_root_config_is_taken_nowhere_below_the_cut() -> None:
    takers = {f"{path.relative_to(ENGINE)}::{name}" for path in _below_the_cut()
              for name in _root_config_takers(path)}
    imports = {t for t in takers if t.endswith("::import")}
    takers -= imports
    assert takers <= ALLOWED_ROOTS, (
        "take the sub-configs the function uses (RunnerConfig, SchedulerConfig, ParallelConfig, "
        f"the ResolvedOffload, ...) as keyword-only arguments, not EngineConfig: "
        f"{sorted(takers - ALLOWED_ROOTS)}")
    allowed_files = {root.split("::")[0] for root in ALLOWED_ROOTS}
    assert {t.split("::")[0] for t in imports} <= allowed_files, (
        f"EngineConfig imported below the cut: {sorted(imports)}")


def test_the_check_sees_every_form_of_taking_the_root_config(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from ditserve.engine.config import EngineConfig\n"
        "def plain(config: EngineConfig) -> None: ...\n"
        "def keyword(*, config: 'EngineConfig | None' = None) -> None: ...\n"
        "class Runner:\n"
        "    def __init__(self, config: cfg.EngineConfig) -> None: ...\n"
        "def fine(scheduler: SchedulerConfig) -> None: ...\n",
        encoding="utf-8")
    assert _root_config_takers(module) == ["import", "plain", "keyword", "Runner.__init__"]
