"""bench/cold_start.py's own bookkeeping: the floor reads every byte once, and the table puts
each start beside it (the servers themselves are started on the device machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from test_bench_tools import BENCH, load


def test_the_floor_reads_every_file_once(tmp_path: Path) -> None:
    bench = load("cold_start")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "w.safetensors").write_bytes(b"x" * 3_000_000)
    (tmp_path / "model_index.json").write_bytes(b"{}")
    floor = bench.read_floor(tmp_path, chunk=1 << 20)
    assert floor["bytes"] == 3_000_002 and floor["seconds"] > 0


def test_the_table_shows_the_phases_that_ran_and_the_ratio_to_the_floor() -> None:
    bench = load("cold_start")
    rows = [("dlo", {"ready_s": 12.0, "phases": {"read": 4.0, "warm_up": 1.5}}),
            ("resident", {"ready_s": 20.0, "phases": {"read": 4.0, "place": 9.0}})]
    lines = bench.table(rows, {"seconds": 4.0}).splitlines()
    assert lines[0] == "| variant | ready | read | place | warm_up | floor | ready/floor |"
    assert lines[2] == "| dlo | 12.00 | 4.00 | - | 1.50 | 4.00 | 3.0x |"
    assert lines[3] == "| resident | 20.00 | 4.00 | 9.00 | - | 4.00 | 5.0x |"


def test_each_image_is_compared_with_the_first_variants() -> None:
    bench = load("cold_start")
    grey = np.full((8, 8, 3), 128, dtype=np.uint8)
    brighter = grey.copy()
    brighter[0, 0, 1] = 131
    rows = [("compile", {"ready_s": 30.0, "phases": {}, "image": grey}),
            ("compile-2nd", {"ready_s": 12.0, "phases": {}, "image": grey.copy()}),
            ("dlo", {"ready_s": 10.0, "phases": {}, "image": brighter}),
            ("resident", {"ready_s": 11.0, "phases": {}, "image": grey[:4]})]
    bench.compare_images(rows)
    verdicts = [r["image"] for _, r in rows]
    assert [v["same"] for v in verdicts] == [True, True, False, False]
    assert verdicts[2]["max_diff"] == 3 and verdicts[3]["max_diff"] is None
    assert verdicts[0]["sha256"] == verdicts[1]["sha256"] != verdicts[2]["sha256"]
    lines = bench.table(rows, {"seconds": 4.0}).splitlines()
    assert lines[0].endswith("| ready/floor | image vs first | vs previous |")
    assert [line.split("|")[-3].strip() for line in lines[2:]] == [
        "same", "same", "max diff 3", "other size"]
    # Each start after the first against the one before it: compile-2nd against compile.
    assert [line.split("|")[-2].strip() for line in lines[2:]] == [
        "-", "same", "max diff 3", "other size"]
    assert "image_vs_previous" not in rows[0][1]
    assert rows[1][1]["image_vs_previous"]["same"] is True


def test_a_cpu_start_makes_its_image_and_reports_it(tmp_path: Path) -> None:
    """Two starts of the tiny Flux on the CPU, each making the check image: same pixels."""
    from ditserve.engine.cli.main import main as ditserve_cli

    model = tmp_path / "tiny-flux"
    assert ditserve_cli(["model", "init-tiny", str(model), "--family", "flux"]) == 0
    out = tmp_path / "cold.json"
    cmd = [sys.executable, str(BENCH / "cold_start.py"), "--model", str(model),
           "--variants", "resident", "dlo", "--image-check", "--image-size", "64x64",
           "--serve-args", "--device cpu", "--timeout", "300",
           "--server-cmd", f"{sys.executable} -m ditserve.engine.cli", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DITSERVE_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"resident", "dlo"}
    assert runs["dlo"]["image"]["same"] and runs["dlo"]["image"]["max_diff"] == 0
    assert runs["resident"]["image"]["sha256"] == runs["dlo"]["image"]["sha256"]
    assert runs["dlo"]["ready_s"] > 0 and "imports" in runs["dlo"]["phases"]
    assert "| same |" in done.stdout
