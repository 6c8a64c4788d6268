"""The runner: one denoising step of a batch on one device.

``model_runner`` (loads the pipeline, wires weights, offload, parallelism and compilation, and
runs a planned step), ``input_batch`` and ``denoise_state`` (the rows of a step and each
request's state between steps), ``group_forwards`` and ``block_major`` (shape groups run through
each streamed block while it is on the device), ``inflight`` (one step queued ahead of the
device), ``sampler`` (the noise-schedule math, with no hidden step counter) and
``compiled_blocks`` (regional compilation). Nothing here knows about HTTP or queues.
"""
