"""Judging a DiffusionDeployment with the engine's own rules, before anything is applied.

Owns the CRD -> engine config mapping and the three judgements a spec passes before the
operator renders it:
- the object's name makes valid names for every child (Service, ConfigMap, Deployment,
  LeaderWorkerSet, PodDisruptionBudget, and the pods those create);
- ``engine.args`` parse with the real ``ditserve serve`` parser (``engine.server.options``,
  pure: judging never imports the server runtime) and set none of the flags the
  operator manages (``--data-parallel-size`` comes from parallelism.data, ``--port`` from
  engine.port, ...): a contradicting flag would override the operator's file in the pod;
- the resulting engine and server configs pass ``EngineConfig`` / ``ServerConfig`` validation,
  the same rules `ditserve serve` applies at start.
Called by ``render`` and ``status``; pure (parsing never touches the filesystem or network).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ditserve.engine.config import EngineConfig, family_sequence_parallel_problems
from ditserve.engine.config.flags import engine_config_from_args
from ditserve.engine.errors import ConfigError
from ditserve.engine.families import AUTO_FAMILY, FAMILIES
from ditserve.engine.server.options import ServeArgsError, parse_serve_args, server_config_from_args
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.jobs import jobs_server_section
from ditserve.operator.loras import lora_args
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.spec import MODEL_MOUNT_PATH, DeploymentSpec, parse_spec
from ditserve.operator.workloads import LWS_SUFFIX

# Children are named after the object (the ConfigMap with "-engine", LeaderWorkerSet pods with
# "-<group>-<index>", their StatefulSets' revision labels with a 10-character hash): a DNS-1035
# label short enough for every suffix.
MAX_NAME_LENGTH = 52
# Multi-node: StatefulSet names <name>-lws-<group> (group < 1000) plus their pods'
# "controller-revision-hash" label (<statefulset>-<10 characters>, at most 63).
MAX_MULTI_NODE_NAME = 63 - 11 - len(LWS_SUFFIX) - 4
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# `ditserve serve` flags the operator sets itself (argparse dest -> (flag, what sets it)).
MANAGED_FLAGS: dict[str, tuple[str, str]] = {
    "config": ("--config", "the operator (ConfigMap <name>-engine)"),
    "model": ("--model", "model.hostPath or model.persistentVolumeClaim"),
    "base_model": ("--base-model", "model.hostPath or model.persistentVolumeClaim (with "
                                   "model.checkpoint: the volume is the base model)"),
    "dtype": ("--dtype", "model.dtype"),
    "device": ("--device", "the operator (one GPU per rank)"),
    "compile": ("--compile", "compile.enabled and compile.backend"),
    "max_num_seqs": ("--max-num-seqs", "batching.maxNumSeqs"),
    "max_queue": ("--max-queue", "batching.maxQueue"),
    "scheduling_policy": ("--scheduling-policy", "scheduling.policy"),
    "priority_aging_s": ("--priority-aging-s", "scheduling.agingSeconds"),
    "max_preemptions": ("--max-preemptions", "scheduling.maxPreemptions"),
    "offload": ("--offload", "offload.enabled"),
    "dlo_slots": ("--dlo-slots", "offload.slots"),
    "dlo_resident_layers": ("--dlo-resident-layers", "offload.residentLayers"),
    "dlo_use_allgather": ("--dlo-no-use-allgather", "offload.useAllGather"),
    "dlo_runtime_cache": ("--dlo-runtime-cache", "offload.runtimeCache.enabled"),
    "dlo_pin_limit_gib": ("--dlo-pin-limit-gib", "offload.runtimeCache.pinLimitGiB"),
    "cache_root": ("--cache-root", "cache.root"),
    "data_parallel_size": ("--data-parallel-size", "parallelism.data"),
    "sequence_parallel_size": ("--sequence-parallel-size", "parallelism.sequence"),
    "host": ("--host", "the operator (the pod listens on every address)"),
    "port": ("--port", "engine.port"),
    "api_key": ("--api-key", "engine.apiKeySecret (a key in the pod spec is readable by anyone "
                             "who can read pods)"),
    "api_key_env": ("--api-key-env", "engine.apiKeySecret"),
}


def name_problems(name: str) -> list[str]:
    """Why ``name`` cannot name this object's children (empty if it can)."""
    out = []
    if len(name) > MAX_NAME_LENGTH:
        out.append(f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children and "
                   f"their pods are named after it), got {len(name)}")
    if not _DNS_1035_LABEL.match(name):
        out.append(f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits "
                   "and '-', starting with a letter): the Service is named after it")
    return out


def engine_mapping(spec: DeploymentSpec) -> dict[str, Any]:
    """The CRD fields as an ``EngineConfig`` mapping (cache root: pods get $DITSERVE_CACHE_ROOT)."""
    mapping: dict[str, Any] = {
        "model": MODEL_MOUNT_PATH,
        "dtype": spec.model.dtype,
        "device": "auto",
        "offload": {
            "enabled": spec.offload.enabled,
            "use_allgather": spec.offload.use_all_gather,
            "resident_layers": spec.offload.resident_layers,
            "runtime_cache": spec.offload.runtime_cache,
            "pin_limit_gib": spec.offload.pin_limit_gib,
        },
        "parallel": {
            "data_parallel_size": spec.parallelism.data,
            "sequence_parallel_size": spec.parallelism.sequence,
        },
        "scheduler": {
            "max_num_seqs": spec.batching.max_num_seqs,
            "max_queue": spec.batching.max_queue,
            "scheduling_policy": spec.scheduling.policy,
            "aging_s": spec.scheduling.aging_seconds,
            "max_preemptions": spec.scheduling.max_preemptions,
        },
        "compile": spec.compile.backend if spec.compile.enabled else None,
    }
    if spec.model.checkpoint is not None:  # a file in the volume; the volume is its base
        mapping["checkpoint"] = f"{MODEL_MOUNT_PATH}/{spec.model.checkpoint}"
    if spec.offload.slots is not None:  # unset: the engine picks per mode
        mapping["offload"]["slots"] = spec.offload.slots
    if spec.offload.hbm_budget_gib is not None:  # the whole pipeline's budget, or "auto"
        mapping["offload"]["hbm_budget_gib"] = spec.offload.hbm_budget_gib
    return mapping


def server_section(spec: DeploymentSpec) -> dict[str, Any]:
    """The ``server:`` section of the engine's config file."""
    return {"host": "0.0.0.0", "port": spec.engine.port, **jobs_server_section(spec.jobs)}


def _jobs_flag_problems(spec: DeploymentSpec, parsed: Any) -> list[str]:
    """Flags ``spec.jobs`` owns when it sets them."""
    owned = {"video_dir": ("--video-dir", "spec.jobs.results", spec.jobs.results_claim),
             "job_store": ("--job-store", "spec.jobs.redis.urlSecret", spec.jobs.url_secret),
             "job_results": ("--job-results", "spec.jobs.results.s3", spec.jobs.s3_url),
             "job_lease": ("--job-lease", "spec.jobs.leaseSeconds", spec.jobs.lease_s)}
    return [f"engine.args must not set {flag}: the operator sets it from {owner}"
            for dest, (flag, owner, value) in owned.items()
            if value is not None and getattr(parsed, dest, None) is not None]


def _parse_serve_args(args: tuple[str, ...]) -> Any:
    """``engine.args`` through the real `ditserve serve` parser; argparse's complaint on error."""
    try:
        return parse_serve_args(args)
    except ServeArgsError as e:
        raise InvalidSpecError(f"engine.args are not valid `ditserve serve` arguments: {e}")\
            from None


def _managed_flag_problems(parsed: Any) -> list[str]:
    return [f"engine.args must not set {flag}: the operator sets it from {owner}"
            for dest, (flag, owner) in MANAGED_FLAGS.items()
            if getattr(parsed, dest, None) is not None]


def _declared_heads_problems(spec: DeploymentSpec) -> list[str]:
    """model.attentionHeads, when declared, judges the SP size exactly (a family only says
    which sizes fit some of its models: Wan's 8 fits the 14B's 40 heads, not the 1.3B's 12)."""
    heads, size = spec.model.attention_heads, spec.parallelism.sequence
    if size <= 1:
        return []
    if heads is None:
        if spec.model.family != AUTO_FAMILY:
            return []  # the declared family's own rule (family_sequence_parallel_problems)
        # Auto: a size that divides no released model of any family serves none of them.
        known = sorted({n for family in FAMILIES for n in family.attention_heads})
        if not known or any(n % size == 0 for n in known):
            return []
        return [f"parallelism.sequence={size} divides the attention head count of no "
                f"supported family's released models ({', '.join(map(str, known))}): declare "
                "model.attentionHeads (the DiT's num_attention_heads) to serve another model"]
    if heads % size == 0:
        return []
    fits = [n for n in range(1, heads + 1) if heads % n == 0]
    return [f"parallelism.sequence={size} does not divide model.attentionHeads={heads}: "
            f"Ulysses gives every SP rank heads/size heads; use one of {fits}"]


def engine_config(spec: DeploymentSpec) -> EngineConfig:
    """The engine config every rank of this deployment runs (the CRD fields, then the engine
    options in ``engine.args``), judged by the engine's own rules; raises InvalidSpecError."""
    config, _ = judge_engine(spec)
    return config


def judge_engine(spec: DeploymentSpec) -> tuple[EngineConfig, Any]:
    """(EngineConfig, ServerConfig) of the pods, or InvalidSpecError listing every problem."""
    parsed = _parse_serve_args((*spec.engine.args, *lora_args(spec.loras)))
    # The model's own head count is read by the engine at start; a declared family's released
    # head counts already tell a sequence-parallel size that serves none of them.
    # A declared head count is exact; a family's released counts only bound what can fit.
    family = [] if spec.model.attention_heads is not None else family_sequence_parallel_problems(
        spec.parallelism.sequence, spec.model.family)
    managed = (_managed_flag_problems(parsed) + _jobs_flag_problems(spec, parsed) + family
               + _declared_heads_problems(spec))
    if spec.offload.hbm_budget_gib is not None and parsed.dlo_hbm_budget_gib is not None:
        managed.append("offload.hbmBudgetGiB and --dlo-hbm-budget-gib in engine.args both set "
                       "the HBM budget; keep one (the CRD field)")
    if managed:
        raise InvalidSpecError("invalid DiffusionDeployment spec:\n  - " + "\n  - ".join(managed))
    try:
        config = engine_config_from_args(parsed, base=engine_mapping(spec))
        # environ={}: the operator never reads the pod's secrets; the key arrives at run time.
        server = server_config_from_args(parsed, base=server_section(spec), environ={})
    except ConfigError as e:
        raise InvalidSpecError(str(e)) from e
    return config, server


def checkpoint_problems(spec: DeploymentSpec) -> list[str]:
    """``model.checkpoint`` must stay inside the model volume (the engine judges the rest)."""
    path = spec.model.checkpoint
    if path is not None and (path.startswith("/") or ".." in path.split("/")):
        return ["model.checkpoint is a file inside the model volume: a relative path without "
                f"'..', got {path!r}"]
    return []


def validate(data: Mapping[str, Any] | None, *, name: str | None = None,
             policy: AdminPolicy | None = None) -> tuple[DeploymentSpec, EngineConfig]:
    """Every judgement at once: the name (when given), the spec's shape, the admin's policy
    (``policy``; default: the chart's default roots), the engine's rules. The spec returned
    has the admin's values filled in (``AdminPolicy.resolve``)."""
    policy = policy or AdminPolicy()
    problems = name_problems(name) if name is not None else []
    try:
        spec = parse_spec(data)
    except InvalidSpecError as e:
        if not problems:
            raise
        raise InvalidSpecError(f"{e}\n  - " + "\n  - ".join(problems)) from None
    if name is not None and spec.parallelism.multi_node and len(name) > MAX_MULTI_NODE_NAME:
        problems.append(f"metadata.name must be at most {MAX_MULTI_NODE_NAME} characters when a "
                        "replica spans nodes (the LeaderWorkerSet's StatefulSets are named "
                        f"<name>{LWS_SUFFIX}-<group>), got {len(name)}")
    problems += policy.problems(spec) + checkpoint_problems(spec)
    if problems:
        raise InvalidSpecError("invalid DiffusionDeployment:\n  - " + "\n  - ".join(problems))
    spec = policy.resolve(spec)
    return spec, engine_config(spec)
