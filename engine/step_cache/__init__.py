"""Step caching: reuse a DiT's residual from an earlier denoising step instead of running its
blocks (First-Block Cache, TeaCache, a fixed schedule), per request.

``spec`` is pure (requests and config carry it); ``policies`` decides per request and step;
``blocks`` runs the decisions inside a step's forwards and tells offload which blocks a step
needs. Nothing is imported here so that the pure part stays importable without torch.
"""
