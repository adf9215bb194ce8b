"""Tokenizers that need no download, built on the Hugging Face ``tokenizers`` library.

``char``: one token per character of a fixed alphabet (exact and tiny; for synthetic tasks).
``bpe``: a byte-level BPE trained offline on the dataset's own text in about a second.
Both save as a standard ``tokenizer.json`` that ``tokenizers``/transformers can load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Sequence

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = [PAD, BOS, EOS]
UNKNOWN = "\ufffd"


class Tokenizer:
    """Thin wrapper: ids in and out, plus the special token ids the trainer needs."""

    def __init__(self, backend: HFTokenizer):
        self.backend = backend
        ids = {tok: backend.token_to_id(tok) for tok in SPECIALS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.pad_id, self.bos_id, self.eos_id = ids[PAD], ids[BOS], ids[EOS]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens dropped (for prompts and display)."""
        return self.backend.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)

    def decode_response(self, ids: Sequence[int]) -> str:
        """Text a reward should judge: everything the model emitted except a final EOS.

        Nothing is hidden: special tokens stay as their names and ids beyond the tokenizer
        (Megatron pads the vocabulary) become U+FFFD, so a policy cannot earn reward by padding
        its answer with tokens that decode to nothing.
        """
        ids = list(ids[:-1] if ids and ids[-1] == self.eos_id else ids)
        pieces, run = [], []
        for i in ids:
            if i < self.vocab_size:
                run.append(i)
                continue
            pieces.append(self.backend.decode(run, skip_special_tokens=False))
            pieces.append(UNKNOWN)
            run = []
        pieces.append(self.backend.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def save(self, path: Path) -> None:
        self.backend.save(str(path))

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))


def char_tokenizer(alphabet: str) -> Tokenizer:
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend)
