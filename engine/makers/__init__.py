"""Model makers: random-weight diffusers pipelines written to disk, for the demo, the tests
and the benchmarks; nothing is downloaded.

``builders`` dispatches to each family's builders (``engine/families/<family>/builders.py``)
and holds the DiT-making mechanics they share; ``released`` builds the components around a
DiT at their released shapes from a family's table; ``tiny_model`` is the embedded default
model (``ditserve model init-tiny``), ``random_model`` the full-size ones
(``ditserve model init-random``).
"""
