"""bench/lora.py's CPU smoke mode: every method and cell runs on a tiny Flux DiT and the
table and JSON come out."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_tools import load  # type: ignore[import-not-found]


def test_tiny_bench_prints_the_table(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bench = load("lora")
    assert bench.main(["--tiny", "--iters", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lora.json").read_text())
    assert set(result["methods"]) == {"resident", "dlo"}
    for method in result["methods"].values():
        assert set(method["ms"]) == {"base b4", "lora b4", "per-adapter 4x b1"}
        assert all(ms > 0 for ms in method["ms"].values())
        assert method["adapter_bytes"] > 0
    printed = capsys.readouterr().out
    assert "| method | base b4 ms | lora b4 ms |" in printed
    assert "| resident |" in printed and "| dlo |" in printed
