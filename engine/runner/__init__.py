"""The runner: one denoising step of a batch on one device.

``model_runner`` (runs a planned step), ``assembly`` (from loaded weights to a pipeline ready
to step: offload, parallelism, adapters, compilation, in that order), ``group_forwards`` and
``block_major`` (shape groups run through each streamed block while it is on the device),
``inflight`` (one step queued ahead of the device) and ``compiled_blocks`` (regional
compilation). The step's data is in ``engine.step``; the placement of the pipeline around the
DiT is in ``engine.placement``. Nothing here knows about HTTP or queues.
"""
