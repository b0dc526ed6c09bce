"""``python vllm_trainer_job.py demo KEY=VALUE ...``: the ``msrl`` command with a probe on the vLLM rollout
engine. After every weight load into the live engine (``VLLMSampler.on_switch``) it appends one JSON line to
``<trainer.output_dir>/probes.jsonl``: the greedy tokens and top-5 log-probs of a fixed prompt, and each
engine worker's transfer counters of backend ``"msrl"`` (``msrl_transfer_stats``). After every sampling call
it appends to ``samples.jsonl`` how many distinct responses each repeated prompt got. The test checks that an
update step changes the engine's outputs, that every load went through the backend, and that the rows of a
group are sampled independently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PROBE = "2+3="


def _install_probe(out: Path) -> None:
    from vllm import SamplingParams

    from msrl_core.trainer.engines import vllm_rollout
    from msrl_core.trainer.task import CharTokenizer

    load = vllm_rollout.VLLMSampler.on_switch
    ids = CharTokenizer().encode(PROBE)

    def on_switch(self: vllm_rollout.VLLMSampler) -> None:
        load(self)
        sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5)
        o = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
        rec = {
            "tokens": list(o.token_ids),
            "top": [sorted(v.logprob for v in lp.values()) for lp in o.logprobs or []],
            "stats": self.llm.collective_rpc("msrl_transfer_stats"),
        }
        with open(out / "probes.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    generate = vllm_rollout.VLLMSampler.generate

    def sample(self: vllm_rollout.VLLMSampler, prompts: Any, *args: Any, **kw: Any) -> Any:
        toks, lps = generate(self, prompts, *args, **kw)
        if not kw.get("greedy", False):
            groups: dict[tuple, set] = {}
            for p, t in zip(prompts, toks):
                groups.setdefault(tuple(p.tolist()), set()).add(tuple(t.tolist()))
            rec = {"distinct": [len(v) for v in groups.values()], "rows": len(prompts)}
            with open(out / "samples.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        return toks, lps

    vllm_rollout.VLLMSampler.on_switch = on_switch  # type: ignore[method-assign]
    vllm_rollout.VLLMSampler.generate = sample  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    from msrl_core import cli

    outs = [a.split("=", 1)[1] for a in argv if a.startswith("trainer.output_dir=")]
    if not outs:
        raise SystemExit("vllm_trainer_job.py needs trainer.output_dir=DIR")
    _install_probe(Path(outs[-1]))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
