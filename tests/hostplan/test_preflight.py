"""Checkpoint mmap preflight: each mismatch falls back to ordinary loading with its reason."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan
from ditserve.engine.weights.backing_choice import checkpoint_dit
from ditserve.engine.weights.loader import DIT_COMPONENT, dit_class

Edit = Callable[[dict[str, torch.Tensor], Path], None]


def variant(tiny_model_dir: Path, tmp_path: Path, edit: Edit) -> Path:
    """A copy of the tiny model's DiT folder whose weights ``edit`` rewrites."""
    root = tmp_path / "model"
    folder = root / DIT_COMPONENT
    folder.mkdir(parents=True)
    shutil.copy(tiny_model_dir / DIT_COMPONENT / "config.json", folder / "config.json")
    (source,) = sorted((tiny_model_dir / DIT_COMPONENT).glob("*.safetensors"))
    tensors = load_file(source)
    edit(tensors, folder)
    return root


def whole(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")


def first_key(tensors: dict[str, torch.Tensor]) -> str:
    return sorted(tensors)[0]


def reshaped(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    k = first_key(tensors)
    tensors[k] = tensors[k].reshape(-1)
    if tensors[k].dim() == 1:
        tensors[k] = torch.cat([tensors[k], tensors[k][:1]])
    whole(tensors, folder)


def half(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    k = first_key(tensors)
    tensors[k] = tensors[k].half()
    whole(tensors, folder)


def dropped(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    del tensors[first_key(tensors)]
    whole(tensors, folder)


def duplicated(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    k = first_key(tensors)
    whole(tensors, folder)
    save_file({k: tensors[k].clone()}, folder / "extra.safetensors")


def mixed(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    tensors["vae.decoder.conv_in.weight"] = torch.zeros(4, 4)  # not a DiT tensor
    whole(tensors, folder)


def sharded(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    names = sorted(tensors)
    half_point = len(names) // 2
    save_file({n: tensors[n] for n in names[:half_point]}, folder / "part-1.safetensors")
    save_file({n: tensors[n] for n in names[half_point:]}, folder / "part-2.safetensors")


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (reshaped, "shape mismatch"),
        (half, "dtype mismatch"),
        (dropped, "missing key"),
        (duplicated, "duplicate source"),
        (mixed, "mixed source"),
    ],
)
def test_mismatch_falls_back_with_reason(tiny_model_dir, tmp_path, edit: Edit, reason: str) -> None:  # type: ignore[no-untyped-def]
    root = variant(tiny_model_dir, tmp_path, edit)
    model, plan = checkpoint_dit(root, dtype="float32", model_cls=dit_class(),
                                 component=DIT_COMPONENT)
    assert model is None
    assert plan.kind is BackingKind.ORDINARY
    assert plan.reason.startswith("checkpoint mmap refused: " + reason), plan.reason


def test_sharded_checkpoint_binds_every_tensor_to_a_read_only_shared_mapping(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = variant(tiny_model_dir, tmp_path, sharded)
    model, plan = checkpoint_dit(root, dtype="float32", model_cls=dit_class(),
                                 component=DIT_COMPONENT)
    assert model is not None and plan.kind is BackingKind.CHECKPOINT_MMAP
    assert plan.coverage.complete and plan.skipped_materialization
    assert {b.file.name for b in plan.bindings.values()} == {"part-1.safetensors",
                                                            "part-2.safetensors"}
    ordinary = dit_class().from_pretrained(tiny_model_dir, subfolder=DIT_COMPONENT)
    for name, t in ordinary.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    # The kernel's view of the mappings: read-only and shared, never writable-private.
    maps = Path("/proc/self/maps").read_text().splitlines()
    perms = {line.split()[1] for line in maps if "part-1.safetensors" in line}
    assert perms == {"r--s"}, perms
    plan.consume()
    plan.close()


def test_plan_is_consumed_exactly_once(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model, plan = checkpoint_dit(tiny_model_dir, dtype="float32", model_cls=dit_class(),
                                 component=DIT_COMPONENT)
    assert model is not None
    sources = plan.consume()
    assert set(sources) == set(plan.bindings) == set(model.state_dict())
    with pytest.raises(OffloadError, match="already handed"):
        plan.consume()
    plan.require_consumed()  # consumed: fine
    plan.close()


def test_unconsumed_skipped_plan_is_a_hard_error_ordinary_is_not(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    _, plan = checkpoint_dit(tiny_model_dir, dtype="float32", model_cls=dit_class(),
                             component=DIT_COMPONENT)
    with pytest.raises(OffloadError, match="refusing to start"):
        plan.require_consumed()
    HostWeightPlan.ordinary("checkpoint mmap off").require_consumed()


def test_auto_maps_the_checkpoint_on_cuda_only_when_the_mapping_can_be_registered(
    tiny_model_dir,  # type: ignore[no-untyped-def]
) -> None:
    from ditserve.engine.config import OffloadConfig
    from ditserve.engine.offload.host.weight_plan import BackingKind
    from ditserve.engine.weights.backing_choice import prepare_dit

    unpinned = OffloadConfig(enabled=True)
    _, plan = prepare_dit(tiny_model_dir, dtype="float32", offload=unpinned,
                          streams_from_mapping=True)
    assert plan.kind == BackingKind.ORDINARY and "--dlo-pin-limit-gib" in plan.reason
    pinned = OffloadConfig(enabled=True, pin_limit_gib=1.0)
    _, plan = prepare_dit(tiny_model_dir, dtype="float32", offload=pinned,
                          streams_from_mapping=True)
    assert plan.kind == BackingKind.CHECKPOINT_MMAP
    _, plan = prepare_dit(tiny_model_dir, dtype="float32", offload=unpinned)
    assert plan.kind == BackingKind.CHECKPOINT_MMAP  # CPU / AllGather shards: always worth it
