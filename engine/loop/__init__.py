"""The engine loop: requests in, steps driven, results out.

``engine`` (the thread-safe request API and the step loops), ``startup`` (load and warm-up),
``pending`` and ``rank_queues`` (requests waiting for a rank), ``delivery`` and ``results``
(progress and outcomes handed back), ``lifecycle`` (the one phase enum and its writer) and
``step_log`` (the per-step record). It decides *when* work runs; the runner decides *how*.
"""
