"""Record what lm-eval's ``local-completions`` model sends and what it makes of our answers.

Run with a Python that has lm-eval installed, against a running ``rackserve serve``:

    python tests/server/helpers/record_lm_eval.py URL MODEL_NAME TOKENIZER_DIR OUT.json

It drives lm-eval's own model class (its payloads and its response parsing) through
loglikelihood, loglikelihood_rolling and generate_until, and writes every request body it
sent with lm-eval's parsed results. tests/server/test_clients.py replays the bodies."""

from __future__ import annotations

import json
import sys

from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI


def main(url: str, model: str, tokenizer: str, out: str) -> None:
    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions", model=model, tokenizer_backend="huggingface",
        tokenizer=tokenizer, num_concurrent=1, max_retries=1, batch_size=2, max_length=512,
    )  # fmt: skip
    bodies: list[dict] = []
    create = lm._create_payload

    def recording(*args, **kwargs):
        body = create(*args, **kwargs)
        bodies.append(json.loads(json.dumps(body)))
        return body

    lm._create_payload = recording
    pairs = [("The harbour was", " quiet"), ("Once upon a", " time"), ("Two plus two is", " four")]
    loglikelihood = lm.loglikelihood(
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    )
    rolling = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, ("A quiet harbour in the morning.",), 0)]
    )
    generated = lm.generate_until(
        [
            Instance(
                "generate_until", {}, ("Q: Say hi.\nA:", {"until": ["\n"], "max_gen_toks": 8}), 0
            )
        ]
    )
    with open(out, "w") as f:
        json.dump(
            {
                "lm_eval_model": "local-completions",
                "request_bodies": bodies,
                "results": {
                    "loglikelihood": loglikelihood,
                    "loglikelihood_rolling": rolling,
                    "generate_until": generated,
                },
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main(*sys.argv[1:5])
