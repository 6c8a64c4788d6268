"""bench/step_syncs.py (issue 47): the workload it drives through an engine, and how
bench/sync_sites.py captures sync warnings from the thread that raised them and groups their
stacks by call site.
The syncs themselves need CUDA; the dry run drives the same workload on the CPU."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch
from test_bench_tools import load  # type: ignore[import-not-found]


def test_the_dry_run_pauses_and_resumes_low_priority_rows_for_urgent_ones(
        tmp_path: Path) -> None:
    bench = load("step_syncs")
    out = tmp_path / "syncs.json"
    # Two low-priority rows run when the urgent one arrives; one companion may stay.
    code = bench.main(["--dry-run", "--family", "z-image", "--policy", "priority",
                       "--steps", "4", "--requests", "3", "--urgent", "1",
                       "--sizes", "32x32,48x32", "--urgent-size", "32x32",
                       "--warmup-rounds", "0", "--sync-steps", "3", "--out", str(out)])
    assert code == 0
    run = json.loads(out.read_text())["runs"]["priority"]
    assert run["finished"] == {"low": 3, "high": 1} and run["failed"] == []
    assert run["pauses"] >= 1 and run["resumes"] >= 1
    assert run["steps"] >= 4  # the window's denoise steps
    assert run["sync_steps"] == 3  # those under sync-debug mode: the per-step rates' denominator
    assert run["syncs"] == 0 and run["sites"] == []  # sync debug mode is off on the CPU
    # One wall time and one sync count per step of the window, to tell a slow step's cause.
    assert len(run["step_walls_s"]) == len(run["step_syncs"]) == run["steps"]
    assert all(w > 0 for w in run["step_walls_s"]) and set(run["step_syncs"]) == {0}


def test_the_round_ends_the_sync_window_once_after_its_steps(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("step_syncs")
    ended: list[int] = []
    syncs = iter([0, 5, 9, 9, 9])  # the capture's count at begin and after each step
    tally = bench.Round()
    tally.begin([], lambda arrival: None,
                bench.SyncWindow(lambda: next(syncs), 2, lambda: ended.append(tally.steps),
                                 lambda: "on" if not ended else "off", lambda: 0.25))
    for _ in range(4):
        tally.on_step(requests=1, rows=1, seconds=0.01)
    assert ended == [2]
    assert tally.step_syncs == [5, 4, 0, 0] and len(tally.step_walls) == 4
    # Each step says, as it ends, its calls and the mode; the window's close is a line too,
    # with the mode read after turning it off (a run cut short still tells whether it was).
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 5
    assert lines[0].startswith("step 1: wall ")
    assert lines[0].endswith("5 synchronizing calls, recording 0.25 s so far, sync-debug mode on")
    assert lines[1].endswith("4 synchronizing calls, recording 0.25 s so far, sync-debug mode on")
    assert lines[2] == "sync window closed after step 2: sync-debug mode off"
    assert lines[4].startswith("step 4: ") and lines[4].endswith("sync-debug mode off")


def test_the_workload_sends_urgent_requests_while_low_priority_ones_run() -> None:
    bench = load("step_syncs")
    arrivals = bench.workload(4, 2, ["32x32", "64x64"], "48x48", steps=8)
    lows = [a for a in arrivals if a.priority > 0]
    highs = [a for a in arrivals if a.priority < 0]
    assert [a.size for a in lows] == ["32x32", "64x64", "32x32", "64x64"]
    assert [a.at_step for a in lows] == [0, 0, 8, 8]  # more admissions later
    assert [a.at_step for a in highs] == [4, 12]  # the first while the first lows run
    assert {a.size for a in highs} == {"48x48"}
    assert [a.at_step for a in arrivals] == sorted(a.at_step for a in arrivals)


def frame(bench, path: str, line: int, function: str):  # type: ignore[no-untyped-def]
    return bench.Frame(path, line, function)


def test_sites_are_the_innermost_ditserve_frame_with_counts_per_step() -> None:
    bench = load("sync_sites")
    roots = [Path("/repo/engine")]
    loop = frame(bench, "/repo/engine/loop/step_loop.py", 70, "_step")
    runner = frame(bench, "/repo/engine/runner/model_runner.py", 300, "_denoise")
    torch_call = frame(bench, "/site/torch/nn/functional.py", 12, "pad")
    other_caller = frame(bench, "/repo/engine/loop/engine.py", 10, "add_request")
    records = [
        bench.SyncRecord("loop", (loop, runner, torch_call)),
        bench.SyncRecord("loop", (other_caller, runner)),  # the same site from elsewhere
        bench.SyncRecord("main", (loop, runner)),
        bench.SyncRecord("main", (frame(bench, "/bench/x.py", 5, "wait"),)),
    ]
    rows = bench.group_sites(records, roots, steps=4)
    assert [(r["site"], r["count"]) for r in rows] == [
        ("engine/runner/model_runner.py:300 _denoise", 3),
        ("(no ditserve frame) /bench/x.py:5 wait", 1)]
    top = rows[0]
    assert top["per_step"] == 0.75 and top["threads"] == ["loop", "main"]
    assert top["stack"] == ["engine/loop/step_loop.py:70 _step",
                            "engine/runner/model_runner.py:300 _denoise"]
    assert top["callee"] == "torch/nn/functional.py:12 pad"  # the call that synchronized
    assert bench.group_sites(records, roots, steps=0)[0]["per_step"] is None


def test_the_capture_records_the_stack_of_the_thread_that_warned() -> None:
    bench = load("sync_sites")

    def synchronizing_call() -> None:
        warnings.warn(f"{bench.SYNC_MESSAGE} (Triggered internally)", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with bench.SyncCapture() as capture:
            worker = threading.Thread(target=lambda: [synchronizing_call() for _ in range(2)],
                                      name="engine-loop")
            worker.start()
            worker.join()
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert capture.intact
    assert [r.thread for r in capture.records] == ["engine-loop", "engine-loop"]
    assert capture.records[0].frames[-1].function == "synchronizing_call"
    assert capture.count == 2 and capture.handler_s > 0
    assert [str(w.message) for w in others] == ["something else"]  # passed on, not recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_without_cuda_it_exits_2_unless_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert load("step_syncs").main(["--policy", "fcfs"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_without_stacks_the_capture_counts_each_thread_and_walks_no_stack(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--no-stacks: the recording's cost leaves the step, so a slow step under sync-debug
    mode is torch's own warning path."""
    bench = load("step_syncs")
    sync_sites = load("sync_sites")
    message = f"Warning: {sync_sites.SYNC_MESSAGE}"
    with sync_sites.SyncCapture(stacks=False) as capture:
        for _ in range(3):
            warnings.warn(message, UserWarning, stacklevel=1)
        worker = threading.Thread(target=warnings.warn, args=(message, UserWarning),
                                  name="loop")
        worker.start()
        worker.join()
    assert capture.count == 4
    assert [r.thread for r in capture.records] == ["MainThread"] * 3 + ["loop"]
    assert all(r.frames == () for r in capture.records)
    run = {"sync_steps": 1, "steps": 1, "wall_s": 1.0, "forward_s": 0.5,
           "outside_forwards_s": 0.5, "pauses": 0, "resumes": 0,
           "finished": {"low": 1, "high": 0}, "requests": 1, "syncs": 4, "failed": [],
           "step_walls_s": [1.0], "step_syncs": [4], "capture_intact": True,
           "handler_s": capture.handler_s, "stacks": False, "sites": []}
    bench.print_run("priority", run, dry_run=False)
    out = capsys.readouterr().out
    assert "4 synchronizing calls" in out
    assert "(--no-stacks: calls counted, no stack walked, no sites)" in out
    assert "no synchronizing call in the window" not in out
