"""GET /health, /ready and /metrics, open without auth: ``routes``.
"""
