"""Adapters that decode other libraries' models through ``GraphBucketRunner``.

``graphbucket.integrations.transformers``: Hugging Face transformers' DeepSeek-V3 and
DeepSeek-V3.2 causal LMs (``pip install 'graphbucket[hf]'``). Nothing here is imported by
``graphbucket`` itself, so the library never needs the optional package.
"""

# The oldest transformers whose model forward fills a cache passed as ``cache=`` (setup.cfg's
# hf extra); an older one leaves it empty, which would surface far from the cause.
MIN_TRANSFORMERS = "5.24"


def check_transformers_version(version: str) -> None:
    """Raise ImportError for a transformers release older than ``MIN_TRANSFORMERS``."""
    def release(v: str) -> tuple[int, ...]:
        return tuple(int("".join(c for c in part if c.isdigit()) or 0)
                     for part in v.split("+")[0].split(".")[:2])
    if release(version) < release(MIN_TRANSFORMERS):
        raise ImportError(f"graphbucket.integrations.transformers needs transformers>="
                          f"{MIN_TRANSFORMERS}, found {version}: pip install 'graphbucket[hf]'")
