"""Video jobs: the job layer of ``/v1/videos``, shared by every replica of a deployment.

``model`` (a job and its OpenAI-shaped object), ``records`` (a job as JSON), ``backend``
(the contract a job store engine meets, and the choice of one from ``--job-store``),
``sqlite_backend`` (the default, one replica) and ``redis_backend`` (many replicas),
``store`` (``JobStore``: bounds, expiry, claims and leases over a backend), ``results``
(the contract of a result store: where finished MP4s are kept), ``files`` (the video
directory: atomic, durable publication of MP4 files), ``s3_results`` (an S3-compatible bucket
every replica reads), ``worker`` (``JobWorker``: a
replica claims jobs when its engine has room, runs them, keeps their leases, writes their
results), ``service`` (``VideoJobs``, what the routes call) and ``errors``. The routes
(``videos/routes.py``) call ``VideoJobs`` and its store only.
"""
