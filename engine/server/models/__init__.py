"""GET /v1/models and /v1/models/{id}: ``routes`` (the served model's card, with its limits
and defaults, and one card per LoRA adapter).
"""
