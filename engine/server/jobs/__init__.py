"""Video jobs: the job layer of ``/v1/videos`` over the same engine handle images use.

``model`` (a job and its OpenAI-shaped object), ``files`` (the content directory: atomic,
durable publication of MP4 files), ``store`` (the bounded, expiring set of jobs) and
``service`` (``VideoJobs``: submits jobs to the engine, follows their progress, encodes and
stores the result). The routes (``routes/videos.py``) call ``VideoJobs`` only.
"""
