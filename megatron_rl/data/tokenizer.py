"""Tokenizers that need no download, built on the Hugging Face ``tokenizers`` library.

``char``: one token per character of a fixed alphabet (exact and tiny; for synthetic tasks).
``bpe``: a byte-level BPE trained offline on the dataset's own text in about a second.
``model``: the checkpoint's own (``model.path``'s ``tokenizer.json``, with the special tokens and
chat template of its ``tokenizer_config.json`` and the stop ids of its ``generation_config.json``).
All save as a standard ``tokenizer.json`` that ``tokenizers``/transformers can load;
``save_pretrained`` adds the ``tokenizer_config.json`` (BOS/EOS/PAD, chat template) and
``generation_config.json`` (EOS/stop and PAD ids) that transformers reads them from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from .chat_template import ChatTemplate
from ..types import token_list

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = [PAD, BOS, EOS]
UNKNOWN = "\ufffd"


class Tokenizer:
    """Thin wrapper: ids in and out, the special token ids the trainer needs, and the chat
    template when the tokenizer came with one.

    ``bos`` may be None (Qwen-style vocabularies have no BOS: prompts then start with their first
    text token); ``pad`` falls back to ``eos``. ``stop_ids`` end a response: ``eos`` plus any the
    checkpoint's generation config names (e.g. ``<|im_end|>`` and ``<|endoftext|>``)."""

    def __init__(self, backend: HFTokenizer, pad: Optional[str] = PAD, bos: Optional[str] = BOS,
                 eos: str = EOS, chat_template: Optional[ChatTemplate] = None,
                 stop_ids: Sequence[int] = ()):
        self.backend = backend
        ids = {tok: backend.token_to_id(tok) for tok in (pad, bos, eos) if tok is not None}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.eos_id = ids[eos]
        self.bos_id: Optional[int] = ids[bos] if bos is not None else None
        self.pad_id = ids[pad] if pad is not None else self.eos_id
        self.eos_token = eos
        self.bos_token = bos
        self.pad_token = pad if pad is not None else eos
        self.chat_template = chat_template
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *stop_ids]))
        # The Hugging Face directory it was read from (data.tokenizer=model), else None.
        self.source_dir: Optional[Path] = None

    def prompt_ids(self, text: str) -> List[int]:
        """Ids of a prompt: BOS (where the vocabulary has one) and the text. A rendered chat
        template places its own BOS (or none), so it is encoded as it is."""
        ids = self.encode(text)
        if self.bos_id is None or (ids and ids[0] == self.bos_id):
            return ids
        return [self.bos_id] + ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens dropped (for prompts and display)."""
        return self.backend.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)

    def decode_with_specials(self, ids: Sequence[int]) -> str:
        """Text of ids with special tokens written out (chat markers such as ``<|im_end|>``)."""
        return self.backend.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=False)

    def decode_response(self, ids: Sequence[int]) -> str:
        """Text a reward should judge: everything the model emitted except a final EOS.

        Nothing is hidden: special tokens stay as their names and ids beyond the tokenizer
        (Megatron pads the vocabulary) become U+FFFD, so a policy cannot earn reward by padding
        its answer with tokens that decode to nothing.
        """
        ids = token_list(ids)
        ids = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
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

    def hf_tokenizer_config(self) -> dict:
        """``tokenizer_config.json`` for transformers' ``AutoTokenizer``: the special tokens the
        trainer used and the chat template."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "pad_token": self.pad_token, "add_bos_token": self.bos_token is not None}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
        return config

    def hf_generation_config(self) -> dict:
        """``generation_config.json``: generation stops at the run's stop ids; PAD and BOS ids."""
        config = {"eos_token_id": list(self.stop_ids) if len(self.stop_ids) > 1 else self.eos_id,
                  "pad_token_id": self.pad_id}
        if self.bos_id is not None:
            config["bos_token_id"] = self.bos_id
        return config

    def save_pretrained(self, directory: Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` into
        ``directory``, so that ``AutoTokenizer``/``GenerationConfig.from_pretrained`` read the
        run's EOS and PAD. A tokenizer read from a checkpoint keeps that checkpoint's files
        (sampling defaults, added tokens), with the keys it lacks filled in."""
        directory = Path(directory)
        if self.source_dir is not None:
            for name in HF_TOKENIZER_FILES:
                if (self.source_dir / name).is_file() and self.source_dir.resolve() != directory.resolve():
                    shutil.copy2(self.source_dir / name, directory / name)
        self.save(directory / "tokenizer.json")
        _fill_json(directory / "tokenizer_config.json", self.hf_tokenizer_config())
        _fill_json(directory / "generation_config.json", self.hf_generation_config())

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))


# The tokenizer files of a Hugging Face directory (copied with it).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                      "chat_template.json")


def _fill_json(path: Path, values: dict) -> None:
    """Write ``values`` into the JSON object at ``path`` where it has no (or a null) value."""
    try:
        current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        current = {}
    if not isinstance(current, dict):
        current = {}
    merged = {**current, **{k: v for k, v in values.items() if current.get(k) is None}}
    if merged != current or not path.is_file():
        path.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")


def complete_hf_tokenizer_dir(directory: Path) -> bool:
    """Give a directory holding a ``tokenizer.json`` the ``tokenizer_config.json`` and
    ``generation_config.json`` keys transformers needs to know EOS and PAD (a run's directory
    before it saved them, or a bare tokenizer.json): EOS from either file, else this project's
    ``<eos>``. Returns whether it knows EOS (False: nothing written)."""
    directory = Path(directory)
    try:
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
    except Exception:  # no tokenizer.json, or files this cannot read: left as they are
        return False
    stop = generation.get("eos_token_id")
    stop = [stop] if isinstance(stop, int) else list(stop or [])
    eos = _token_text(config.get("eos_token")) or (backend.id_to_token(stop[0]) if stop else None)
    if eos is None and backend.token_to_id(EOS) is not None:
        eos = EOS
    if eos is None or backend.token_to_id(eos) is None:
        return False
    pad = _token_text(config.get("pad_token")) or (PAD if backend.token_to_id(PAD) is not None and eos == EOS else eos)
    bos = _token_text(config.get("bos_token"))
    if bos is None and "bos_token" not in config and eos == EOS and backend.token_to_id(BOS) is not None:
        bos = BOS
    tokenizer = Tokenizer(backend, pad=pad, bos=bos, eos=eos, stop_ids=stop)
    _fill_json(directory / "tokenizer_config.json", tokenizer.hf_tokenizer_config())
    _fill_json(directory / "generation_config.json", tokenizer.hf_generation_config())
    return True


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


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); fix the file") from None


def load_pretrained_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer a Hugging Face checkpoint directory ships: ``tokenizer.json``; BOS, EOS, PAD
    and the chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``); extra stop
    ids from ``generation_config.json``. Raises ValueError with one line naming the file and fix."""
    root = Path(directory)
    file = root / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"data.tokenizer=model: {file} not found; copy the checkpoint's tokenizer.json "
                         "there or choose data.tokenizer=char|bpe")
    backend = HFTokenizer.from_file(str(file))
    config = _read_json(root / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    bos, eos, pad = (_token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
    generation = _read_json(root / "generation_config.json")
    stop = generation.get("eos_token_id", [])
    stop = [stop] if isinstance(stop, int) else list(stop)
    if eos is None and stop:
        eos = backend.id_to_token(stop[0])
    if eos is None:
        raise ValueError(f"{root / 'tokenizer_config.json'}: no eos_token (and generation_config.json names no "
                         "eos_token_id); add \"eos_token\": \"<the end-of-turn token>\"")
    for name, tok in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if tok is not None and backend.token_to_id(tok) is None:
            raise ValueError(f"{root / 'tokenizer_config.json'}: {name} {tok!r} is not in tokenizer.json's vocabulary")
    chat = ChatTemplate(template, bos, eos) if template else None
    # Plain prompts start with BOS where the checkpoint has one, unless its config says not to add it.
    if not config.get("add_bos_token", bos is not None):
        bos = None
    tokenizer = Tokenizer(backend, pad=pad, bos=bos, eos=eos, chat_template=chat, stop_ids=stop)
    tokenizer.source_dir = root
    return tokenizer


# A ChatML template with tools in the Qwen/Hermes convention (``<tool_call>{json}</tool_call>``),
# for tokenizers this project trains itself (``write_chat_tokenizer``).
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}{% if sys %}{{ sys + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\nCall a function by writing <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. Functions:\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif sys -%}{{ '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{ '<tool_call>' }}{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def write_chat_tokenizer(directory: Path, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` with ChatML's special tokens and save it as a Hugging
    Face tokenizer directory: ``tokenizer.json`` and a ``tokenizer_config.json`` holding the chat
    template (tools included), EOS ``<|im_end|>`` and PAD ``<|endoftext|>``. Offline, ~1 s. For
    tiny agent runs and tests; real checkpoints ship their own."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [
        backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]}, indent=1))
    return load_pretrained_tokenizer(str(directory))
