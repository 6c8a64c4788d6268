"""bench/cold_start.py's own bookkeeping: the floor reads every byte once, and the table puts
each start beside it (the servers themselves are started on the device machine)."""

from __future__ import annotations

from pathlib import Path

from test_bench_tools import load


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
