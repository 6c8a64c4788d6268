"""The engine loop: requests in, steps driven, results out.

``engine`` (the thread-safe request API and the step loops), ``startup`` (load and warm-up),
``client`` (the ``EngineClient`` protocol: the one seam the server reads the engine
through), ``pending`` (requests waiting for a rank), ``delivery`` and ``results``
(progress and outcomes handed back), ``lifecycle`` (the one phase enum and its writer) and
``step_log`` (the per-step record). It decides *when* work runs; the runner decides *how*.
"""
