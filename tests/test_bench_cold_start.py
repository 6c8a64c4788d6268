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


def test_the_table_shows_the_imports_and_the_wait_for_them() -> None:
    from ditserve.engine.runner.start_phases import PHASES

    bench = load("cold_start")
    assert bench.PHASES == PHASES  # every phase the engine reports has its column
    rows = [("dlo", {"ready_s": 10.0,
                     "phases": {"process": 3.0, "imports": 6.0, "imports_wait": 2.5}})]
    lines = bench.table(rows, {"seconds": 1.0}).splitlines()
    assert lines[0] == ("| variant | ready | process | imports | imports_wait | floor "
                        "| ready/floor |")
    assert lines[2] == "| dlo | 10.00 | 3.00 | 6.00 | 2.50 | 1.00 | 10.0x |"
