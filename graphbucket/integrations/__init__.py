"""Adapters that decode other libraries' models through ``GraphBucketRunner``.

``graphbucket.integrations.transformers``: Hugging Face transformers' DeepSeek-V3 and
DeepSeek-V3.2 causal LMs (``pip install 'graphbucket[hf]'``). Nothing here is imported by
``graphbucket`` itself, so the library never needs the optional package.
"""
