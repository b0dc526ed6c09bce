"""The reference GRPO trainer (``msrl train``): config, algorithm, stages, engines, metrics/report."""
