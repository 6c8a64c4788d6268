"""Scheduling: which requests each engine step runs, and in what order they are admitted.

Pure Python, no torch (an import-linter contract keeps it so). ``scheduler`` is the step
scheduler (``schedule()`` decides a step, ``update()`` applies its result); ``policy`` holds
the admission orders (arrival or priority) and whom to pause; ``deadlines`` the measured step
time and finish estimates; ``work`` the rows x tokens rule a step's budget counts in;
``rank_queues`` the data-parallel ranks' queues. The plan a step hands the runner is per-step
data and lives in ``engine.step.plan``. The package's ``__init__`` imports nothing.
"""
