"""Write a small chat tokenizer directory for agent runs on a model without a checkpoint.

A byte-level BPE trained offline (~1 s) on a JSONL dataset's prompts and answers plus the
calculator agent's fixed texts, with ChatML's special tokens and a chat template that renders
tools and ``<tool_call>`` blocks; loadable with ``data.tokenizer=model data.tokenizer_path=DIR``
(or copied into an HF checkpoint directory). Real checkpoints ship their own tokenizer.

    python tools/make_chat_tokenizer.py runs/chat_tokenizer
    python tools/make_chat_tokenizer.py runs/chat_tokenizer --data ../shared/data/gsm8k/train.jsonl --vocab-size 1000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.data.datasets import DatasetError, read_jsonl  # noqa: E402
from megatron_rl.data.tokenizer import write_chat_tokenizer  # noqa: E402
from megatron_rl.rollout.agent.calculator import tokenizer_texts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write tokenizer.json and tokenizer_config.json into")
    parser.add_argument("--data", default="../shared/data/gsm8k/train.jsonl", help="JSONL file to train on")
    parser.add_argument("--prompt-key", default="question")
    parser.add_argument("--answer-key", default="answer")
    parser.add_argument("--rows", type=int, default=2000, help="rows of --data to train on")
    parser.add_argument("--vocab-size", type=int, default=1000)
    args = parser.parse_args()
    try:
        rows = read_jsonl(args.data, [args.prompt_key, args.answer_key])[:args.rows]
    except DatasetError as err:
        print(f"make_chat_tokenizer: error: {err}", file=sys.stderr)
        return 2
    texts = [r[args.prompt_key] + " " + r[args.answer_key] for r in rows] + tokenizer_texts()
    tok = write_chat_tokenizer(args.out, texts, args.vocab_size)
    print(f"wrote {args.out}/tokenizer.json ({tok.vocab_size} tokens) and tokenizer_config.json (ChatML chat template)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
