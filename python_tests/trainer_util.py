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

#: A tiny ``msrl train`` config (no demo keys): the HF engine, 4 prompts x 4 samples, no validation.
TINY_RUN = [
    "actor.engine=hf",
    "model.arch=llama",
    "model.vocab_size=18",
    "model.qkv_bias=false",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.max_position_embeddings=32",
    "data.global_batch_size=4",
    "data.val_fraction=0",
    "rollout.n=4",
    "rollout.max_prompt_length=8",
    "rollout.max_response_length=3",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size=8",
    "actor.lr=1e-3",
    "dock.warehouses=2",
    "reshard.bucket_mb=1",
    "trainer.device=cpu",
    "trainer.val_every=0",
]
