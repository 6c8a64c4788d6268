"""Child process of test_compile_cache: compile one small function with inductor, loading the
node cache's artifacts first (``load``) or saving them after (``save``), on the device named by the third argument (default cpu); prints a JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from ditserve.engine.runner import compile_cache

mode, root = sys.argv[1], Path(sys.argv[2])
device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
key = compile_cache.CompileKey(model="m", shapes=((8, 8, 1),), backend="inductor",
                               dtype="float32", offload=False, sp_size=1,
                               torch_version=compile_cache.torch_version(),
                               device=compile_cache.device_name(device))
loaded = compile_cache.load(root, key) if mode == "load" else False
compiled = torch.compile(lambda x: torch.sin(x) * 2 + x.sum(), backend="inductor")
compiled(torch.randn(8, 8, device=device))
saved = compile_cache.save(root, key, socket_path=root / "cachectl.sock") if mode == "save" else False
print(json.dumps({"loaded": loaded, "saved": saved,
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
