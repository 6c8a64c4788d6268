"""parse_spec and engine_config: the CRD spec read into typed values and mapped onto the
engine's own config, judged by the engine's rules."""

from __future__ import annotations

import pytest

from ditserve.operator.cache_pod import ensure_container
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import engine_config, validate
from ditserve.operator.spec import parse_spec


def test_mapping_onto_the_engine_config() -> None:
    spec, config = validate({
        "model": {"persistentVolumeClaim": {"claimName": "m", "subPath": "flux"},
                  "dtype": "float16", "sizeGiB": 12},
        "parallelism": {"data": 2, "sequence": 3},
        "offload": {"enabled": True, "useAllGather": False, "residentLayers": 2,
                    "runtimeCache": {"enabled": True, "pinLimitGiB": 8}},
        "batching": {"maxNumSeqs": 6, "maxQueue": 0},
    })
    assert spec.parallelism.gpus_per_pod == 6
    assert config.dtype == "float16" and config.model == "/models/model"
    assert (config.parallel.data_parallel_size, config.parallel.sequence_parallel_size) == (2, 3)
    off = config.offload
    assert (off.enabled, off.use_allgather, off.resident_layers, off.runtime_cache,
            off.pin_limit_gib) == (True, False, 2, True, 8.0)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_queue) == (6, 0)
    assert off.cache_root is None  # pods get it from $DITSERVE_CACHE_ROOT


def test_compile_maps_onto_the_engine_backend_and_is_off_by_default() -> None:
    base = {"model": {"hostPath": "/mnt/models/m"}}
    assert validate(base)[1].compile is None
    assert validate({**base, "compile": {"enabled": True}})[1].compile == "inductor"
    assert validate({**base, "compile": {"enabled": True, "backend": "aot_eager"}})[1].compile == "aot_eager"
    assert validate({**base, "compile": {"backend": "eager"}})[1].compile is None  # not enabled
    with pytest.raises(InvalidSpecError, match="spec.compile.backend must be one of inductor"):
        validate({**base, "compile": {"enabled": True, "backend": "tvm"}})


def test_slots_pass_through_only_when_set() -> None:
    base = {"model": {"hostPath": "/mnt/models/m", "sizeGiB": 1}, "parallelism": {"data": 2}}
    _, config = validate({**base, "offload": {"enabled": True, "slots": 6}})
    assert config.offload.slots == 6
    _, config = validate({**base, "offload": {"enabled": True}})
    assert config.offload.slots is None  # the engine picks: 8 with AllGather, else 2
    with pytest.raises(InvalidSpecError, match="spec.offload.slots must be an integer >= 2"):
        validate({**base, "offload": {"enabled": True, "slots": 1}})


def test_every_shape_problem_is_reported_at_once() -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec({"model": {"hostPath": "/mnt/models/m", "dtype": "int4"}, "replicas": True,
                    "parallelism": {"data": 0}, "engine": {"port": "http"}})
    message = str(info.value)
    for expected in ("spec.model.dtype must be one of", "spec.replicas must be an integer",
                     "spec.parallelism.data must be an integer >= 1", "spec.engine.port must be"):
        assert expected in message


def test_missing_model_says_how_to_fix_it() -> None:
    with pytest.raises(InvalidSpecError, match="set model.hostPath, model.persistentVolumeClaim or model.uri"):
        parse_spec({})


@pytest.mark.parametrize(("offload", "parallelism", "engine_says"), [
    ({"residentLayers": 2}, {}, "only apply with offload enabled"),
    ({"enabled": True, "residentLayers": 2}, {"data": 2}, "not supported with AllGather"),
    ({"enabled": True, "runtimeCache": {"enabled": True, "pinLimitGiB": 4}}, {"sequence": 2},
     "pin_limit_gib registers runtime-cache mappings"),
])
def test_engine_rules_judge_option_combinations(offload: dict, parallelism: dict,
                                                engine_says: str) -> None:
    spec = parse_spec({"model": {"hostPath": "/mnt/models/m", "sizeGiB": 1}, "offload": offload,
                       "parallelism": parallelism})
    with pytest.raises(InvalidSpecError, match=engine_says):
        engine_config(spec)


@pytest.mark.parametrize(("family", "sequence", "ok"), [
    ("Flux", 2, True), ("Flux", 3, True), ("Flux", 8, True),  # 24 heads
    ("Flux", 5, False), ("QwenImage", 7, False),
    ("Wan", 5, True),  # 12, 24 and 40 heads: 5 divides the 14B DiTs' 40
    ("Wan", 7, False),
    ("Auto", 5, True),  # unknown heads: fits a released model (40), the engine checks the rest
    ("Auto", 7, True),  # MiniMax-H3 (56 heads); no size within a node fits none now
    # The edit families: Qwen-Image's DiT (24 heads), FLUX.1 Kontext's Flux's.
    ("QwenImageEdit", 4, True), ("QwenImageEdit", 5, False),
    ("QwenImageEditPlus", 8, True), ("QwenImageEditPlus", 7, False), ("FluxKontext", 5, False),
    ("ZImage", 5, True), ("ZImage", 4, False),  # Z-Image's 30 heads
])
def test_sequence_parallel_sizes_are_judged_by_the_familys_head_counts(
        family: str, sequence: int, ok: bool) -> None:
    spec = parse_spec({"model": {"hostPath": "/mnt/models/m", "family": family},
                       "parallelism": {"sequence": sequence, "gpusPerNode": 8}})
    if ok:
        assert engine_config(spec).parallel.sequence_parallel_size == sequence
        return
    with pytest.raises(InvalidSpecError, match="divides (no|the) attention head count") as e:
        engine_config(spec)
    assert "model.attentionHeads" in str(e.value)  # how to serve a model with other heads


def test_an_sp_group_spanning_nodes_is_refused() -> None:
    spec = {"model": {"hostPath": "/mnt/models/m"}, "parallelism": {"data": 2, "sequence": 8,
                                                          "gpusPerNode": 4}}
    with pytest.raises(InvalidSpecError, match="stay inside one node"):
        parse_spec(spec)
    spec["parallelism"]["gpusPerNode"] = 8  # two pods of one 8-GPU SP group each
    assert parse_spec(spec).parallelism.pods_per_replica == 2


@pytest.mark.parametrize("family", ["QwenImageEdit", "QwenImageEditPlus"])
def test_edit_families_take_the_dlo_rules_of_the_others(family: str) -> None:
    base = {"model": {"hostPath": "/mnt/models/m", "sizeGiB": 40, "family": family}}
    _, config = validate({**base, "offload": {"enabled": True},
                          "parallelism": {"sequence": 2, "gpusPerNode": 8}})
    assert config.offload.enabled and config.parallel.sequence_parallel_size == 2
    with pytest.raises(InvalidSpecError, match="not supported with AllGather"):
        engine_config(parse_spec({**base, "offload": {"enabled": True, "residentLayers": 2},
                                  "parallelism": {"data": 2}}))


def test_model_checkpoint_names_a_file_in_the_model_volume() -> None:
    base = {"model": {"hostPath": "/mnt/models/flux", "checkpoint": "gguf/flux1-dev-Q8_0.gguf"}}
    spec, config = validate(base)
    assert spec.model.checkpoint == "gguf/flux1-dev-Q8_0.gguf"
    # the volume is the base model; the engine serves the file's DiT
    assert config.model == "/models/model"
    assert config.checkpoint == "/models/model/gguf/flux1-dev-Q8_0.gguf"
    assert validate({"model": {"hostPath": "/mnt/models/flux"}})[1].checkpoint is None
    for bad in ("/etc/passwd", "../other/flux.gguf"):
        with pytest.raises(InvalidSpecError, match="model.checkpoint is a file inside"):
            validate({"model": {"hostPath": "/mnt/models/flux", "checkpoint": bad}})
    # the node cache holds the file's DiT as stored; the ensure container builds that entry
    cached = parse_spec({"model": {**base["model"], "sizeGiB": 13},
                         "offload": {"enabled": True, "runtimeCache": {"enabled": True}}})
    assert engine_config(cached).offload.runtime_cache
    command = ensure_container(cached, "helper:1")["command"]
    model = command[command.index("--model") + 1]
    assert model == "/mnt/models/flux/gguf/flux1-dev-Q8_0.gguf"
    assert command[command.index("--base-model") + 1] == "/mnt/models/flux"
