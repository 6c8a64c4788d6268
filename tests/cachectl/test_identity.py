"""Entry identity: what changes the key, what must not, and the recipe/identity split."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cachectl_support import make_identity

from ditserve.cachectl.errors import InvalidIdentityError
from ditserve.cachectl.identity import (
    Placement,
    canonical_json,
    recipe_for,
    source_digest,
    source_fingerprint,
)


def test_dp_rank_dp_size_and_sp_rank_do_not_change_the_key() -> None:
    base = make_identity(placement=Placement(sp_size=2, sp_impl="ulysses"))
    for placement in (Placement(dp_size=4, dp_rank=3, sp_size=2, sp_impl="ulysses"),
                      Placement(dp_size=2, dp_rank=0, sp_size=2, sp_rank=1, sp_impl="ulysses")):
        assert make_identity(placement=placement).key == base.key


@pytest.mark.parametrize("change", [
    {"placement": Placement(tp_size=2, tp_rank=1)},
    {"placement": Placement(tp_size=2, tp_rank=0)},
    {"placement": Placement(sp_size=2, sp_impl="ulysses")},
    {"placement": Placement(sp_size=2, sp_impl="ring")},
    {"dtype": "bfloat16"},
    {"model_digest": "f" * 64},
    {"revision": "v2"},
    {"loader_version": "2"},
    {"loader_inputs": {"diffusers": "0.43.0"}},
    {"components": ("transformer", "vae")},
])
def test_weight_relevant_fields_change_the_key(change: dict) -> None:
    assert make_identity(**change).key != make_identity().key


def test_tp_ranks_get_distinct_keys() -> None:
    keys = {make_identity(placement=Placement(tp_size=4, tp_rank=r)).key for r in range(4)}
    assert len(keys) == 4


def test_key_is_sha256_of_canonical_identity_json() -> None:
    import hashlib

    ident = make_identity()
    assert ident.key == hashlib.sha256(canonical_json(ident.to_json())).hexdigest()
    # Frozen on purpose: a change here re-keys every cache in the field (bump SCHEMA_VERSION).
    assert ident.to_json() == {
        "schema": 2, "model": {"digest": "0" * 64, "revision": None}, "dtype": "float32",
        "loader": {"name": "tests.synthetic", "version": "1", "inputs": {}},
        "components": ["transformer"],
        "parallel": {"tp_size": 1, "tp_rank": 0, "sp_impl": None, "sp_size": 1},
    }


@pytest.mark.parametrize("bad", [
    {"dtype": "float64"},
    {"model_digest": "not-a-digest"},
    {"components": ()},
    {"loader_version": ""},
])
def test_invalid_identities_are_rejected(bad: dict) -> None:
    with pytest.raises(InvalidIdentityError):
        make_identity(**bad)


@pytest.mark.parametrize("kwargs", [{"dp_size": 2, "dp_rank": 2}, {"tp_size": 0},
                                    {"sp_size": 2, "sp_rank": -1}])
def test_placement_rejects_ranks_outside_their_group(kwargs: dict) -> None:
    with pytest.raises(InvalidIdentityError):
        Placement(**kwargs)


def test_recipe_resolves_to_the_same_identity_and_has_its_own_key() -> None:
    recipe = recipe_for(source_fingerprint="a" * 64, dtype="float32", loader="tests.synthetic",
                        loader_version="1")
    ident = recipe.identity("0" * 64)
    assert ident.key == make_identity().key
    assert recipe.key != ident.key


def _model(tmp_path: Path) -> list[Path]:
    (tmp_path / "transformer").mkdir(parents=True)
    files = [tmp_path / "transformer" / "config.json",
             tmp_path / "transformer" / "weights.safetensors"]
    files[0].write_text("{}")
    files[1].write_bytes(b"\x00" * 1000)
    return files


def test_source_digest_follows_content_not_timestamps(tmp_path: Path) -> None:
    files = _model(tmp_path)
    digest, fingerprint = source_digest(files, tmp_path), source_fingerprint(files, tmp_path)
    os.utime(files[1], ns=(1, 1))
    assert source_digest(files, tmp_path) == digest
    assert source_fingerprint(files, tmp_path) != fingerprint  # a touch misses the recipe
    files[1].write_bytes(b"\x01" + b"\x00" * 999)
    assert source_digest(files, tmp_path) != digest


def test_the_fingerprint_does_not_depend_on_where_the_model_is_mounted(tmp_path: Path) -> None:
    # The node daemon sees the model at its node path, an engine pod at its mount path: the
    # same files (here hard links, as a bind mount shows them) must give the same recipe.
    node = tmp_path / "node" / "flux"
    files = _model(node)
    pod = tmp_path / "pod" / "models" / "flux"
    (pod / "transformer").mkdir(parents=True)
    linked = []
    for f in files:
        target = pod / "transformer" / f.name
        os.link(f, target)
        linked.append(target)
    assert source_fingerprint(linked, pod) == source_fingerprint(files, node)
    assert source_digest(linked, pod) == source_digest(files, node)
    # A copy is other files (other inodes): another fingerprint, the same digest.
    copy = tmp_path / "copy"
    copied = _model(copy)
    copied[1].write_bytes(files[1].read_bytes())
    assert source_fingerprint(copied, copy) != source_fingerprint(files, node)
    assert source_digest(copied, copy) == source_digest(files, node)


def test_hub_style_symlinked_files_are_named_inside_the_model_dir(tmp_path: Path) -> None:
    # A hub cache snapshot: every file is a symlink to a blob outside the model directory.
    plain = tmp_path / "plain"
    files = _model(plain)
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    snapshot = tmp_path / "hub" / "snapshots" / "abc123"
    (snapshot / "transformer").mkdir(parents=True)
    links = []
    for i, f in enumerate(files):
        blob = blobs / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        link = snapshot / "transformer" / f.name
        link.symlink_to(os.path.relpath(blob, link.parent))
        links.append(link)
    assert source_digest(links, snapshot) == source_digest(files, plain)
    before = source_fingerprint(links, snapshot)
    # Repointing a link at another blob is a change of the model.
    other = blobs / "other"
    other.write_bytes(files[1].read_bytes())
    links[1].unlink()
    links[1].symlink_to(other)
    assert source_fingerprint(links, snapshot) != before


def test_a_source_file_outside_the_model_dir_is_refused(tmp_path: Path) -> None:
    files = _model(tmp_path / "m")
    with pytest.raises(InvalidIdentityError, match="not inside"):
        source_fingerprint([*files, tmp_path / "elsewhere.json"], tmp_path / "m")
