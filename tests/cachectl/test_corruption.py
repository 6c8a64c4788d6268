"""Damaged entries: verify names entry and file and fails; join refuses; nothing is repaired."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cachectl_support import make_identity, synthetic_tensors

from ditserve.cachectl.cli import main
from ditserve.cachectl.errors import EntryCorruptError, ManifestError
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


def header_rewritten(entry: Path, shard: str) -> str:
    # Same length, different tensor name: the bytes hash the same, the header does not.
    p = _writable(entry / shard)
    data = p.read_bytes()
    p.write_bytes(data.replace(b"blocks.", b"blockz.", 1))
    return shard


DAMAGES: list[Callable[[Path, str], str]] = [
    flip_byte, truncate, extra_file, missing_file, symlinked_file, manifest_not_json,
    manifest_shape_lie, manifest_other_key, header_rewritten,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_damage_is_named_by_verify_and_refused_by_join(
    store: CacheStore, damage: Callable[[Path, str], str], capsys: pytest.CaptureFixture[str],
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
    assert err.value.key == ident.key and bad_file in str(err.value)

    rc = main(["--root", str(store.root), "verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    by_key = {r["key"]: r for r in out}
    assert by_key[good.key]["ok"] and not by_key[ident.key]["ok"]
    assert bad_file in {p["file"] for p in by_key[ident.key]["problems"]}
    assert entry_dir.exists()  # reported, not repaired or removed


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
