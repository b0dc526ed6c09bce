"""allgather-swap resharding: Megatron training layout -> vLLM / Hugging Face inference layout, and the swap
of the training weights to pinned host memory. See docs/reshard.md."""

from msrl_core.reshard.broadcast import RolloutBroadcast
from msrl_core.reshard.errors import ReshardError, SwapStateError, SwitchAborted, SwitchTimeout
from msrl_core.reshard.layout import ModelConfig, Parallel
from msrl_core.reshard.memory import MemoryProbe
from msrl_core.reshard.offload import OffloadedState, OffloadTelemetry, TrainingStateOffload
from msrl_core.reshard.plan import Bucket, ReshardPlan, StreamBucket, execute_numpy, megatron_to_vllm, to_hf
from msrl_core.reshard.stream import BucketStream, StreamTelemetry, stream_buckets
from msrl_core.reshard.swap import (
    Swap,
    SwapTelemetry,
    Switcher,
    allgather_swap,
    default_switcher,
    naive_reshard,
)

__all__ = [
    "Bucket",
    "BucketStream",
    "MemoryProbe",
    "ModelConfig",
    "OffloadTelemetry",
    "OffloadedState",
    "Parallel",
    "ReshardError",
    "ReshardPlan",
    "RolloutBroadcast",
    "Swap",
    "StreamBucket",
    "StreamTelemetry",
    "SwapStateError",
    "SwapTelemetry",
    "SwitchAborted",
    "SwitchTimeout",
    "Switcher",
    "TrainingStateOffload",
    "allgather_swap",
    "default_switcher",
    "execute_numpy",
    "megatron_to_vllm",
    "naive_reshard",
    "stream_buckets",
    "to_hf",
]
