"""A full disk under a video job, on a real tiny tmpfs in a private mount namespace: the job
fails with a clear error, no partial file is left or served, its bytes are freed, and the
next job that fits is stored."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cachectl_support import in_mount_namespace, require_mounts

CHILD = Path(__file__).with_name("video_disk_child.py")
TESTS = Path(__file__).parent.parent


def test_a_full_disk_fails_the_job_cleanly(tmp_path: Path) -> None:
    require_mounts()
    root = tmp_path / "tiny"
    root.mkdir()
    # No empty PYTHONPATH entry: it would put the checkout's operator/ before the stdlib's.
    paths = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    # 48 KiB: room for a small MP4, not for 33 frames of 64x64 noise (~130 KB).
    out = in_mount_namespace([f"mount -t tmpfs -o size=48k tmpfs {root}"],
                             [sys.executable, str(CHILD), str(root), str(tmp_path)], env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    big = seen["big"]
    assert big["status"] == "failed" and big["progress"] < 100
    assert big["error"]["code"] == "storage_full"
    assert "no space left in the video directory" in big["error"]["message"]
    assert seen["big_content"] == [409, "video_unavailable"]
    assert seen["files_after_failure"] == [".tmp"]  # no partial MP4, no temp file
    assert seen["store_bytes"] == ["ditserve:video_store_bytes 0.0"]  # reservation freed
    assert seen["small"] == "completed" and seen["small_content"][0] == 200
