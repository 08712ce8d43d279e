"""graphbucket: bucketed FULL CUDA graphs for MLA decode."""

__version__ = "0.1.0"
