"""Per-step data: what one denoise step is made of, below everything that uses it.

``plan`` holds the scheduler's side (``ScheduledRequest``, ``StepPlan``, ``RunnerOutput``,
``StatusChange``; pure Python); ``denoise_state`` a request's state on the device side,
``input_batch`` the rows of one step's forward, and ``sampler`` the noise-schedule math
(no step counter: the step index lives on the request's state). The scheduler, the runner,
the pipelines and the step cache all import this package downward; it imports none of them.
The package's ``__init__`` imports nothing, so the pure ``plan`` stays free of torch.
"""
