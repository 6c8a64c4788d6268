"""The video mode of bench/serving.py, as its CPU smoke run: two real servers on the tiny Wan
model (resident and DLO at max_num_seqs 2), every job completed with an MP4, the report
written with its target rows (their values are timings: reported, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "serving.py"


def test_video_smoke_run(tiny_wan: Path, tmp_path: Path) -> None:
    out = tmp_path / "video.json"
    run = subprocess.run([sys.executable, str(BENCH), "video", "--smoke", "--model",
                          str(tiny_wan), "--out", str(out)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["results"]] == ["resident@2", "dlo@2"]
    for result in report["results"]:
        summary = result["summary"]
        assert (summary["ok"], summary["errors"]) == (3, 0)
        assert summary["videos_per_hour"] > 0 and summary["mean_mp4_bytes"] > 0
        assert summary["video_seconds"] == 3 * 9 / 16  # three 9-frame videos at 16 fps
        assert all(r["status"] == "completed" for r in result["records"])
    assert report["results"][1]["offload"]["enabled"] is True
    assert [t["what"] for t in report["targets"]] == ["DLO@2 videos/h >= 0.97x resident@2"]
    assert "target: DLO@2 videos/h" in run.stdout
