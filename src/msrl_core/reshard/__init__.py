"""allgather-swap resharding: Megatron training layout -> vLLM / Hugging Face inference layout, and the swap
of the training weights to pinned host memory. See docs/reshard.md."""

from msrl_core.reshard.broadcast import RolloutBroadcast
from msrl_core.reshard.errors import ReshardError, SwapStateError
from msrl_core.reshard.layout import ModelConfig, Parallel
from msrl_core.reshard.plan import Bucket, ReshardPlan, StreamBucket, execute_numpy, megatron_to_vllm, to_hf
from msrl_core.reshard.stream import BucketStream, StreamTelemetry, stream_buckets
from msrl_core.reshard.swap import Swap, allgather_swap, naive_reshard

__all__ = [
    "Bucket",
    "BucketStream",
    "ModelConfig",
    "Parallel",
    "ReshardError",
    "ReshardPlan",
    "RolloutBroadcast",
    "Swap",
    "StreamBucket",
    "StreamTelemetry",
    "SwapStateError",
    "allgather_swap",
    "execute_numpy",
    "megatron_to_vllm",
    "naive_reshard",
    "stream_buckets",
    "to_hf",
]
