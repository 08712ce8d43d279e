"""Ladder tuning: measure the decode kernel, choose bucket bounds and hints, ship ladders.

- ``grid``: what to measure (contexts, hints, the split counts or plans they capture) and
  the timing table (host);
- ``measure``: CUDA-graph timing of the MLA decode kernel over a cold L2 (needs CUDA);
- ``choose``: the exact choice of bounds and per-batch hints from a timing table (host);
- ``shipped``: the tuned ladders in ``graphbucket/ladders/`` and their lookup by GPU name.

``scripts/tune_ladder.py`` runs them in order.
"""
