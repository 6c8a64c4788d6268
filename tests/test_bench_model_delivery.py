"""bench/model_delivery.py at a small size: the issue-50 outcomes hold (one download for three
pods, a killed daemon's download resumed where the disk stopped, a flipped byte fetched again
once and refused when it persists), judged on the bytes the local hub served. Real processes
(`cachectl serve`, three `cachectl pull --daemon-only` pods); timings are printed, never
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_tools import load

pytestmark = pytest.mark.slow
MIB = 2**20


def test_the_model_is_a_real_diffusers_folder_with_readable_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    bench = load("delivery_fixture")  # the model is built there, beside the node's processes
    files = bench.model_files(3 * MIB)
    assert abs(sum(len(d) for d in files.values()) - 3 * MIB) < 2 * bench.COLUMNS * 2
    assert json.loads(files["model_index.json"])["_class_name"] == "FluxPipeline"
    for name in (bench.BIG, bench.VAE):
        path = tmp_path / name.replace("/", "_")
        path.write_bytes(files[name])
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            assert names and all(f.get_slice(k).get_dtype() == "BF16" for k in names)
    assert bench.model_files(3 * MIB) == files  # seeded: the same bytes every run


def test_three_pods_one_download_resume_after_kill_and_corruption_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("model_delivery")
    out = tmp_path / "rows.json"
    # huggingface_hub writes a download in 10 MiB chunks: half of a ~30 MiB file leaves one
    # chunk on disk when the daemon is killed, so there is something to resume from.
    assert bench.main(["--size-mib", "32", "--kill-at", "0.5", "--workdir", str(tmp_path / "w"),
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    size = report["model_bytes"]
    rows = {r["scenario"]: r for r in report["rows"]}
    assert report["ok"] == [True] * 4

    once = rows["once"]
    assert once["served"] == size  # every byte of the model served exactly once
    keys = {p["key"] for p in once["pods"]}
    assert len(keys) == 1 and all(p["rc"] == 0 and p["via"] == "daemon" for p in once["pods"])
    assert once["one_entry"] and once["verified"]

    resume = rows["resume"]
    assert 0 < resume["on_disk_at_kill"] < size
    # The restarted daemon asked for the big file from where its bytes on disk ended, and the
    # hub sent exactly what was missing: nothing twice.
    big_on_disk = resume["big_get_starts_after_restart"][0]
    assert big_on_disk >= 10 * MIB
    assert resume["served_after_restart"] == resume["missing_at_kill"]
    assert resume["one_entry"] and resume["verified"]
    assert {p["key"] for p in resume["pods"]} == keys  # the same entry as the first node's

    flipped = rows["flipped"]
    assert flipped["rc"] == 0 and flipped["one_entry"] and flipped["verified"]
    # Caught by its digest and fetched once more; the files that matched were kept.
    assert flipped["served"] == size + report["files"][bench.BIG]

    corrupt = rows["corrupt"]
    assert corrupt["rc"] == 3 and corrupt["published"] == []  # exit 3: the source's fault
    assert corrupt["served"] == size + report["files"][bench.BIG]  # two tries, then refused
    assert "differ from the digests the source published" in corrupt["error"]
    assert bench.BIG in corrupt["error"]

    table = capsys.readouterr().out
    assert "| once | 32.0 | 32.0 | 1.000x |" in table
    assert table.count("| yes |") == 4
