"""A full disk and exhausted inodes, on a real tiny tmpfs in a private mount namespace: one
clean "not enough space" error, nothing left behind, and the next publication works once
there is room. Best-effort records (recipes, stamps) on a full disk leave no temp file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cachectl_support import in_mount_namespace, require_mounts

CHILD = Path(__file__).parent / "disk_child.py"


def _run(tmp_path: Path, mode: str, options: str) -> dict:
    require_mounts()
    root = tmp_path / "tiny"
    root.mkdir()
    out = in_mount_namespace([f"mount -t tmpfs -o {options} tmpfs {root}"],
                             [sys.executable, str(CHILD), mode, str(root)])
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


def test_preflight_refuses_what_cannot_fit(tmp_path: Path) -> None:
    seen = _run(tmp_path, "preflight", "size=16m")
    assert seen["unit"] == "bytes" and "not enough space" in seen["error"]
    assert "cachectl gc --max-bytes N" in seen["error"]
    assert seen["built_after"] is None
    assert seen["keys"] == [] and seen["left"] == []


def test_a_disk_that_fills_during_the_write_is_a_clean_error(tmp_path: Path) -> None:
    # 80 MiB passes the preflight (entry + 64 MiB margin); then another writer fills it.
    seen = _run(tmp_path, "fill-bytes", "size=80m")
    assert seen["unit"] == "bytes" and "not enough space" in seen["error"]
    assert seen["keys"] == [] and seen["left"] == []  # the temp dir is gone
    assert seen["built_after"] is True


def test_running_out_of_inodes_during_the_write_is_a_clean_error(tmp_path: Path) -> None:
    seen = _run(tmp_path, "fill-inodes", "size=80m,nr_inodes=400")
    assert seen["unit"] == "inodes" and "not enough space" in seen["error"]
    assert seen["keys"] == [] and seen["left"] == []
    assert seen["built_after"] is True


def test_too_few_inodes_are_refused_before_writing(tmp_path: Path) -> None:
    # 129 shards need 131 inodes; the layout's directories already took some of 64.
    seen = _run(tmp_path, "preflight-inodes", "size=80m,nr_inodes=64")
    assert seen["unit"] == "inodes" and "free inodes" in seen["error"]
    assert seen["keys"] == [] and seen["left"] == []


def test_records_on_a_full_disk_leave_no_temp_files(tmp_path: Path) -> None:
    seen = _run(tmp_path, "record-full", "size=80m")
    assert seen["recorded"] is False and seen["verify_ok"] is True
    assert seen["stamped"] is False  # best effort: a lost stamp costs a re-hash later
    assert seen["left"] == []
