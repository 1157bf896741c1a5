"""Prompt tokenization and output text for the twin's server.

When the served MODEL is a folder holding ``tokenizer.json``, prompts are encoded with the
``tokenizers`` library exactly as vLLM's fast tokenizer would (completions with special tokens,
chat prompts rendered through the folder's ``chat_template`` and encoded without them), so the
usage counts match what real vLLM reports for that folder.

Otherwise the count is a deterministic approximation: words and punctuation are split with a regex,
a special token such as ``<|eot_id|>`` counts one, words longer than four characters count one
token per four characters (about 1.3 tokens per English
word, close to Llama-3's tokenizer on prose), and ids are a hash of the piece. Only usage counts and
the length checks depend on it; /v1/models is unaffected.

Output text is one deterministic pseudo-word per generated token, so ``completion_tokens`` and the
number of words agree.
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import jinja2

# The Llama-3 chat layout; used when the folder has no chat_template or there is no folder.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el", "or", "is",
              "ul", "ba", "ce", "fi", "go", "ha")
# 20**3 words of three syllables: plenty of variety, cheap to index.
_WORDS = tuple(" " + a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES)
# A special token (<|eot_id|>) is one piece and one token, as in every real tokenizer.
_PIECE = re.compile(r"<\|[^|<>\s]+\|>|\w+|[^\w\s]")

# ShareGPT-like reply lengths when the simulated model may stop on its own (median ~200 tokens).
EOS_MEDIAN_TOKENS = 200.0
EOS_SIGMA = 0.9


def pseudo_word(token_id: int, position: int) -> str:
    """The text of one generated token: a pseudo-word fixed by the token id and its position."""
    return _WORDS[(token_id * 2654435761 + position * 40503) % len(_WORDS)]


def draw_eos_after(prompt_token_ids: list[int], seed: int, min_tokens: int, max_tokens: int) -> int:
    """How many tokens the simulated model writes before its end-of-sequence token.

    Drawn from a lognormal seeded by the prompt and the server's --seed, so the same request gets
    the same length (as greedy decoding would); at least max(1, min_tokens). A draw past
    ``max_tokens`` is returned as it is: the reply is cut by max_tokens first, and vLLM then
    finishes it with "length", not "stop" (only an EOS at or before the cap is a stop).
    """
    del max_tokens  # kept in the signature: callers pass the cap, the engine applies it
    key = zlib.crc32(json.dumps(prompt_token_ids[-256:]).encode(), seed & 0xFFFFFFFF)
    rng = random.Random(key)
    n = round(math.exp(rng.gauss(math.log(EOS_MEDIAN_TOKENS), EOS_SIGMA)))
    return max(max(1, min_tokens), n)


@dataclass
class TwinTokenizer:
    """Encodes prompts and renders chat messages for one served model."""

    exact: bool  # True when a tokenizer.json from the model folder is in use
    vocab_size: int
    chat_template: str
    bos_token: str = "<|begin_of_text|>"
    eos_token: str = "<|eot_id|>"
    _hf: object | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as vLLM's tokenizer would produce them."""
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = []
        for m in _PIECE.finditer(text):
            piece = m.group()
            if piece.startswith("<|"):
                ids.append(zlib.crc32(piece.encode()) % self.vocab_size)
                continue
            for i in range(0, len(piece), 4):
                ids.append(zlib.crc32(piece[i:i + 4].encode()) % self.vocab_size)
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat request, through the chat template."""
        template = _compile(self.chat_template)
        return template.render(messages=messages, bos_token=self.bos_token,
                               eos_token=self.eos_token,
                               add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat request; vLLM encodes the rendered template without special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``: the tokenizer's own decoding, or pseudo-words when approximated
        (the approximation hashes text pieces, so it cannot be inverted)."""
        if self._hf is not None:
            return self._hf.decode(token_ids, skip_special_tokens=False)
        return "".join(pseudo_word(t, i) for i, t in enumerate(token_ids))

    def token_str(self, token_id: int, position: int) -> str:
        """The text of one token, as /tokenize's token_strs and logprobs show it."""
        if self._hf is not None:
            return self._hf.id_to_token(token_id) or ""
        return pseudo_word(token_id, position)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _TEMPLATES.get(source)
    if template is None:
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = _TEMPLATES[source] = env.from_string(source)
    return template


def load_tokenizer(model: str, vocab_size: int = 128256,
                   chat_template: str | None = None) -> TwinTokenizer:
    """The tokenizer for MODEL: the folder's tokenizer.json when there is one, else the approximation.

    ``chat_template`` is vLLM's --chat-template: a file or the template itself.
    """
    folder = Path(model).expanduser()
    config: dict = {}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    template = _token_text(config.get("chat_template")) or DEFAULT_CHAT_TEMPLATE
    if chat_template:
        path = Path(chat_template).expanduser()
        template = path.read_text() if path.is_file() else chat_template
    tok = TwinTokenizer(exact=False, vocab_size=vocab_size, chat_template=template,
                        bos_token=_token_text(config.get("bos_token")) or "<|begin_of_text|>",
                        eos_token=_token_text(config.get("eos_token")) or "<|eot_id|>")
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok._hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.exact = True
        tok.vocab_size = tok._hf.get_vocab_size()
    return tok


def _token_text(value) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):  # a list of named templates: take the default one
        for item in value:
            if isinstance(item, dict) and item.get("name") == "default":
                return item.get("template")
        return None
    return value
