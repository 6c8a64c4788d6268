"""Shared mechanics of the random-weight model builders.

Each family's own builders live in its folder (``engine/families/<family>/builders.py``) and
expose ``build_pipeline(variant, size, *, dtype, device, seed)`` and
``build_tiny(variant, seed)``; the family record names the module (``Family.builders``) and
``engine.model_builders`` dispatches to it. ``released`` builds the components around a DiT
at their released shapes from a family's table, for any family.
"""
