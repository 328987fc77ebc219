"""Hugging Face transformers' embeddings and reranker logits for the embedding tests, computed in
a subprocess (this file run as a script): the tests' own processes stay torch-free, as a server's
main process does.

For each token-id list: the final-norm hidden states (``model.model(...).last_hidden_state``,
what ``AutoModel`` gives and what sentence-transformers pools) pooled by the last token, the
mean and the first token, unnormalized, and the logits of the given token ids at the last
position, all in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def hf_embeddings(model_dir: Path, inputs: list[list[int]], logit_ids: list[int]) -> list[dict]:
    spec = {"model": str(model_dir), "inputs": inputs, "logit_ids": logit_ids}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return json.loads(done.stdout)


def _compute(spec: dict) -> list[dict]:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32
    ).eval()
    ids = torch.tensor(spec["logit_ids"], dtype=torch.int64)
    out = []
    with torch.no_grad():
        for tokens in spec["inputs"]:
            hidden = model.model(torch.tensor([tokens])).last_hidden_state[0].float()
            logits = model.lm_head(hidden[-1:]).float()[0]
            out.append(
                {
                    "last": hidden[-1].tolist(),
                    "mean": hidden.mean(0).tolist(),
                    "cls": hidden[0].tolist(),
                    "logits": logits.index_select(0, ids).tolist(),
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps(_compute(json.loads(sys.stdin.read()))))
