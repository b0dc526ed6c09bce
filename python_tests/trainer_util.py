"""Shared settings of the trainer tests."""

#: 4 prompts x 4 samples per step, one process, a short warm-up: small enough for a loaded 2-core machine.
TINY = [
    "actor.tp=1",
    "data.global_batch_size=4",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size=8",
    "demo.records=120",
    "demo.warmup_steps=2",
]
