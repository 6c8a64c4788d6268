"""Per-request LoRA adapters: many adapters in one denoise step, one pass of the base weights.

- ``config``: ``AdapterConfig`` (``--lora-modules``, ``--max-loras``, ``--max-lora-rank``,
  ``--lora-fuse``) and the ``NAME=PATH[:SCALE]`` parsers; pure.
- ``catalog``: the engine's names -> files, load generations and in-use counts (what the HTTP
  routes and ``/v1/models`` read); pure.
- ``files``: an adapter file -> per-module low-rank factors for the DiT, converted by the
  family's own diffusers LoRA loader (PEFT/diffusers keys, kohya / ComfyUI Flux keys).
- ``rows``: which rows of the running forward carry which adapters (a context variable).
- ``linear``: the hook on a DiT ``nn.Linear`` (or FP8 linear): the base output for every row,
  plus each adapter's low-rank delta on its own rows.
- ``bank``: the model runner's resident adapters (LRU under ``--max-loras``), the hooks they
  need, fusing for ``--lora-fuse``, and their bytes.

The scheduler only carries each request's ``LoraRef``s (``engine.request``) and counts their
work (``engine.sched.work``); nothing else above the runner knows adapters exist. See docs/lora.md.
"""
