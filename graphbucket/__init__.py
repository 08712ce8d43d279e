"""graphbucket: bucketed FULL CUDA graphs for MLA decode.

One FULL graph per (padded batch size, context bucket), each planned with a representative
host hint; every graph shares one set of static buffers and one memory pool; each decode
step picks its graph from host-known lengths, with no device sync.

- ``GraphBucketRunner``: captures and replays the graphs around a decode forward;
- ``GraphSelector`` / ``GraphKey``: the selection alone, for an engine with its own graphs;
- ``BucketLadder`` / ``Bucket`` / ``default_ladder``: context buckets and their hints;
- ``DecodeBatch``, ``BufferSpec``, ``InputSpec``, ``DecodeContext``: what a step carries;
- ``BlockTable``: the runner's persistent host block table (stage only what changed);
- ``LaunchPlan`` / ``plan_mla_decode`` / ``get_backend``: the kernels' host decisions.

Importing graphbucket sets nothing in the environment. Without a GPU, the Triton kernels
run in Triton's interpreter: set ``TRITON_INTERPRET=1`` before the first kernel is used.
"""

from graphbucket.backends import get_backend
from graphbucket.batch import DecodeBatch
from graphbucket.block_table import BlockTable
from graphbucket.context import DecodeContext
from graphbucket.graphs import CaptureSummary
from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.plan import LaunchPlan, plan_mla_decode
from graphbucket.policies import POLICIES
from graphbucket.runner import GraphBucketRunner, RunnerStats
from graphbucket.select import GraphKey, GraphSelector
from graphbucket.spec import BufferSpec, InputSpec

__version__ = "0.1.0"

__all__ = ["POLICIES", "BlockTable", "Bucket", "BucketLadder", "BufferSpec", "CaptureSummary",
           "DecodeBatch", "DecodeContext", "GraphBucketRunner", "GraphKey", "GraphSelector",
           "InputSpec", "LaunchPlan", "RunnerStats", "__version__", "default_ladder", "get_backend",
           "plan_mla_decode"]
