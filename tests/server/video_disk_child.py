"""Child of test_video_disk_full.py: a video app on a tiny filesystem (argv[1], a tmpfs the
parent mounted in a private mount namespace). Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from server.video_support import fake_video_engine, finish, run, video_app

from ditserve.engine.server.config import ServerConfig

root = Path(sys.argv[1])
big = {"prompt": "noise", "size": "64x64", "num_frames": 33, "seed": 1}
small = {"prompt": "noise", "size": "16x16", "num_frames": 1, "seed": 2}
# The job store on another filesystem: the tiny one is for the MP4s alone.
store = f"sqlite:///{Path(sys.argv[2]) / 'jobs.sqlite3'}"
app, _ = video_app(fake_video_engine(Path(sys.argv[2])),
                   ServerConfig(video_dir=str(root), job_store=store))


async def script(client):
    seen = {}
    job = (await client.post("/v1/videos", json=big)).json()
    seen["big"] = (await finish(client, job["id"]))[-1][1]["video"]
    content = await client.get(f"/v1/videos/{job['id']}/content")
    seen["big_content"] = [content.status_code, content.json()["error"]["code"]]
    seen["files_after_failure"] = sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")
    metrics = (await client.get("/metrics")).text
    seen["store_bytes"] = [line for line in metrics.splitlines()
                           if line.startswith("ditserve:video_store_bytes ")]
    job = (await client.post("/v1/videos", json=small)).json()
    seen["small"] = (await finish(client, job["id"]))[-1][1]["video"]["status"]
    content = await client.get(f"/v1/videos/{job['id']}/content")
    seen["small_content"] = [content.status_code, len(content.content)]
    return seen


print(json.dumps(run(app, script)))
