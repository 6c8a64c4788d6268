"""Damaged entries: verify names entry and file and fails; join refuses; nothing is repaired.

The table holds the damages caught since schema 1 and the five that schema 1 let pass (a
byte flipped together with its file's digest, an edited tensor digest, edited created_at and
writer, an entry directory that is a symlink out of the root), plus damages only the piece
digests and the header digest see."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cachectl_support import make_identity, synthetic_tensors

from ditserve.cachectl.cli import main
from ditserve.cachectl.digests import file_digest, manifest_digest, over_pieces
from ditserve.cachectl.errors import EntryCorruptError, EntryUnavailableError, ManifestError
from ditserve.cachectl.manifest import Manifest
from ditserve.cachectl.store import CacheStore


def _writable(path: Path) -> Path:
    os.chmod(path, 0o644)  # shards and manifests are published read-only
    return path


def flip_byte(entry: Path, shard: str) -> str:
    p = _writable(entry / shard)
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01
    p.write_bytes(bytes(data))
    return shard


def truncate(entry: Path, shard: str) -> str:
    p = _writable(entry / shard)
    os.truncate(p, p.stat().st_size - 100)
    return shard


def extra_file(entry: Path, shard: str) -> str:
    (entry / "stray.bin").write_bytes(b"x")
    return "stray.bin"


def missing_file(entry: Path, shard: str) -> str:
    (entry / shard).unlink()
    return shard


def symlinked_file(entry: Path, shard: str) -> str:
    target = entry.parent.parent / "elsewhere.safetensors"
    (entry / shard).rename(target)
    (entry / shard).symlink_to(target)
    return shard


def manifest_not_json(entry: Path, shard: str) -> str:
    _writable(entry / "manifest.json").write_text("{ not json")
    return "manifest.json"


def manifest_shape_lie(entry: Path, shard: str) -> str:
    m = _writable(entry / "manifest.json")
    data = json.loads(m.read_text())
    data["tensors"][0]["shape"] = [1]
    m.write_text(json.dumps(data))
    return "manifest.json"


def manifest_other_key(entry: Path, shard: str) -> str:
    m = _writable(entry / "manifest.json")
    data = json.loads(m.read_text())
    data["identity"]["dtype"] = "bfloat16"
    m.write_text(json.dumps(data))
    return "manifest.json"


def _edit_manifest(entry: Path, edit: Callable[[dict], None], *, reseal: bool = True) -> str:
    m = _writable(entry / "manifest.json")
    data = json.loads(m.read_text())
    edit(data)
    if reseal:  # as a careful editor would: the manifest's own digest made to match again
        data["manifest_digest"] = manifest_digest(data)
    m.write_text(json.dumps(data))
    return "manifest.json"


def _last_tensor(data: dict, shard: str) -> dict:
    return max((t for t in data["tensors"] if t["file"] == shard), key=lambda t: t["offset"])


def flip_byte_and_its_file_digest(entry: Path, shard: str) -> str:
    # The byte's piece, tensor and file digests all recomputed: only the content digest (and
    # the data) still disagree.
    flip_byte(entry, shard)
    data_bytes = (entry / shard).read_bytes()

    def edit(data: dict) -> None:
        t = _last_tensor(data, shard)
        last = len(t["pieces"]) - 1
        start = t["offset"] + last * data["piece_bytes"]
        t["pieces"][last] = hashlib.sha256(data_bytes[start:t["offset"] + t["nbytes"]]).hexdigest()
        t["sha256"] = over_pieces([bytes.fromhex(p) for p in t["pieces"]])
        f = next(f for f in data["files"] if f["name"] == shard)
        ordered = sorted((x for x in data["tensors"] if x["file"] == shard), key=lambda x: x["offset"])
        f["sha256"] = file_digest(f["header_sha256"], [x["sha256"] for x in ordered])

    _edit_manifest(entry, edit)
    return "manifest.json"


def tensor_digest_edited(entry: Path, shard: str) -> str:
    def edit(data: dict) -> None:
        _last_tensor(data, shard)["sha256"] = "0" * 64

    return _edit_manifest(entry, edit)


def piece_digest_edited(entry: Path, shard: str) -> str:
    def edit(data: dict) -> None:
        _last_tensor(data, shard)["pieces"][0] = "f" * 64

    return _edit_manifest(entry, edit)


def created_at_edited(entry: Path, shard: str) -> str:
    return _edit_manifest(entry, lambda d: d.update(created_at="1999-01-01T00:00:00+00:00"),
                          reseal=False)


def writer_edited(entry: Path, shard: str) -> str:
    return _edit_manifest(entry, lambda d: d.update(writer={"host": "elsewhere", "pid": 1}),
                          reseal=False)


def entry_is_a_symlink_out_of_the_root(entry: Path, shard: str) -> None:
    outside = entry.parent.parent.parent.parent / f"outside-{entry.name[:8]}"
    entry.rename(outside)
    entry.symlink_to(outside)
    return None  # an entry-level problem


def header_metadata_changed(entry: Path, shard: str) -> str:
    # Same length, still valid JSON, same tensors: only the header digest sees it.
    p = _writable(entry / shard)
    data = p.read_bytes()
    p.write_bytes(data.replace(b'"format":"pt"', b'"format":"pu"', 1))
    return shard


def header_rewritten(entry: Path, shard: str) -> str:
    # Same length, different tensor name: the bytes hash the same, the header does not.
    p = _writable(entry / shard)
    data = p.read_bytes()
    p.write_bytes(data.replace(b"blocks.", b"blockz.", 1))
    return shard


DAMAGES: list[Callable[[Path, str], str | None]] = [
    flip_byte, truncate, extra_file, missing_file, symlinked_file, manifest_not_json,
    manifest_shape_lie, manifest_other_key, header_rewritten,
    # passed schema 1:
    flip_byte_and_its_file_digest, tensor_digest_edited, created_at_edited, writer_edited,
    entry_is_a_symlink_out_of_the_root,
    # new with schema 2:
    piece_digest_edited, header_metadata_changed,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_damage_is_named_by_verify_and_refused_by_join(
    store: CacheStore, damage: Callable[[Path, str], str | None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = make_identity(seed=1)
    store.publish(good, synthetic_tensors(seed=1)).close()
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        entry_dir = e.path
        shard = e.manifest.files[0].name
    bad_file = damage(entry_dir, shard)

    reports = {r.key: r for r in store.verify()}
    assert reports[good.key].ok
    bad = reports[ident.key]
    assert not bad.ok and bad_file in {p.file for p in bad.problems}

    with pytest.raises(EntryCorruptError) as err:
        store.join(ident.key, full=True)
    assert err.value.key == ident.key and (bad_file or "symlink") in str(err.value)

    rc = main(["--root", str(store.root), "verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    by_key = {r["key"]: r for r in out}
    assert by_key[good.key]["ok"] and not by_key[ident.key]["ok"]
    assert bad_file in {p["file"] for p in by_key[ident.key]["problems"]}
    assert os.path.lexists(entry_dir)  # reported, not repaired or removed


def test_flipped_byte_names_the_damaged_tensor(store: CacheStore) -> None:
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        shard = e.manifest.files[-1].name
        last = max((t for t in e.manifest.tensors if t.file == shard), key=lambda t: t.offset)
        entry_dir = e.path
    flip_byte(entry_dir, shard)
    (report,) = store.verify([ident.key])
    assert last.name in report.problems[0].what


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd", "sub/dir.safetensors",
                                  "..", ".hidden", ""])
def test_manifest_file_names_cannot_escape_the_entry(store: CacheStore, name: str) -> None:
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        data = e.manifest.to_json()
        entry_dir = e.path
    old = data["files"][0]["name"]
    data["files"][0]["name"] = name
    for t in data["tensors"]:
        if t["file"] == old:
            t["file"] = name
    with pytest.raises(ManifestError, match="not a plain name"):
        Manifest.from_json(data)
    _writable(entry_dir / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EntryCorruptError, match="not a plain name"):
        store.join(ident.key)


def test_a_tensor_pointing_to_an_unlisted_escape_path_is_rejected(store: CacheStore) -> None:
    with store.publish(make_identity(), synthetic_tensors()) as e:
        data = e.manifest.to_json()
    data["tensors"][0]["file"] = "../../outside.safetensors"
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_a_flipped_byte_in_a_large_tensor_names_its_piece(tmp_path: Path) -> None:
    import numpy as np

    from ditserve.cachectl.hashing import PIECE_BYTES

    store = CacheStore(tmp_path / "c")
    big = np.zeros(3 * PIECE_BYTES // 4 + 7, dtype=np.float32)  # 3 pieces and a bit
    ident = make_identity()
    with store.publish(ident, {"big": big}) as e:
        (t,) = e.manifest.tensors
        shard, entry_dir = t.file, e.path
        assert len(t.pieces) == 4
    p = _writable(entry_dir / shard)
    with open(p, "r+b") as f:
        f.seek(t.offset + 2 * PIECE_BYTES + 5)
        f.write(b"\x01")
    (report,) = store.verify([ident.key])
    assert "big (piece 2)" in report.problems[0].what


def test_an_entry_of_an_older_schema_is_refused_with_how_to_rebuild(
    store: CacheStore, capsys: pytest.CaptureFixture[str],
) -> None:
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        entry_dir = e.path
    m = _writable(entry_dir / "manifest.json")
    m.write_text(json.dumps({**json.loads(m.read_text()), "schema": 1}))
    with pytest.raises(EntryUnavailableError, match="older cachectl.*cachectl rm"):
        store.join(ident.key)
    assert main(["--root", str(store.root), "verify", ident.key]) == 3  # not corruption
    assert f"OUTDATED {ident.key}" in capsys.readouterr().out
    assert main(["--root", str(store.root), "rm", ident.key]) == 0
