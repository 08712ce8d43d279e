"""Ladder tuning: measure the decode kernel, choose bucket bounds and hints, ship ladders.

- ``measure``: CUDA-graph timing of the MLA decode kernel over a cold L2 (needs CUDA);
- ``choose``: the exact choice of bounds and per-batch hints from a timing table (host);
- ``shipped``: the tuned ladders in ``graphbucket/ladders/`` and their lookup by GPU name.

``scripts/tune_ladder.py`` runs the three in order.
"""
