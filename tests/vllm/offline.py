"""Runs vllm.LLM on converted models, one engine after the other in this process, and writes what each returned.

    python -m tests.vllm.offline JOBS.json OUT.json

JOBS: a list of {"model": DIR, "engine": LLM keyword arguments, "batches": [[{"prompt": [ids], "max_tokens": n,
"prompt_logprobs": bool}, ...], ...]}; each batch is one LLM.generate call (its requests batched together), greedy.
OUT: per job, per batch, per request: {"tokens": [...], "prompt_logprobs": [logprob of each prompt token after the
first] or None, "cached": prompt tokens served from the prefix cache}. The tests run it as a process of its own, so
vLLM's global state (its config, its distributed environment) never lives in the test process.
"""
import gc
import json
import sys

from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
from vllm.inputs import TokensPrompt


def run(job: dict) -> list:
    llm = LLM(job["model"], skip_tokenizer_init=True, **job["engine"])
    out = []
    for batch in job["batches"]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True, detokenize=False,
                                 prompt_logprobs=0 if r.get("prompt_logprobs") else None) for r in batch]
        results = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in batch], params, use_tqdm=False)
        rows = []
        for r, res in zip(batch, results):
            logprobs = None
            if res.prompt_logprobs is not None:
                logprobs = [entry[token].logprob for token, entry in zip(r["prompt"][1:], res.prompt_logprobs[1:])]
            rows.append({"tokens": list(res.outputs[0].token_ids), "prompt_logprobs": logprobs,
                         "cached": res.num_cached_tokens or 0})
        out.append(rows)
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    return out


if __name__ == "__main__":
    jobs = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as f:
        json.dump([run(job) for job in jobs], f)
