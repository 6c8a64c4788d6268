"""POST /v1/images/generations: ``routes`` (the route) and ``openapi`` (its body and
answers). The request itself is ``generation``'s, shared with the edits route.
"""
