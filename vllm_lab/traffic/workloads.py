"""Request generation: prompt and output lengths, prompt text, files, turns and shared prefixes.

Every request is a pure function of (seed, global request index), so the same seed gives the same
request sequence at every sweep point and on every worker, whatever the number of workers.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from vllm_lab.inputs import CONFIG_BYTES, DATA_BYTES, InputError, load_json, read_text, shown
from vllm_lab.traffic.spec import Lengths, Workload
from vllm_lab.traffic.traces import MAX_INT_DIGITS, MAX_TOKENS

# Common English words that GPT-2/Llama-3-style BPE vocabularies hold as one token each with
# their leading space; without a tokenizer a prompt of N of them is taken as N tokens.
_WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "she", "there", "been", "one", "all", "we", "their", "has",
    "would", "when", "if", "so", "what", "out", "up", "more", "who", "will", "no", "some",
    "time", "can", "them", "other", "into", "than", "its", "only", "could", "new", "these",
    "may", "two", "first", "any", "then", "like", "well", "also", "back", "after", "use",
    "our", "over", "such", "how", "work", "where", "most", "way", "even", "made", "many",
    "down", "before", "good", "very", "through", "long", "must", "each", "people", "year",
    "same", "take", "still", "man", "just", "little", "own", "under", "might", "great", "last",
    "old", "world", "life", "both", "while", "never", "day", "part", "place", "find", "state",
    "house", "show", "again", "small", "number", "hand", "high", "large", "point", "group",
    "end", "week", "city", "game", "water", "line", "name", "order", "home", "book", "room",
    "light", "story", "study", "night", "fact", "money", "area", "case", "power", "school",
    "music", "road", "field", "river", "price", "table", "paper", "voice", "window", "garden",
    "market", "letter", "summer", "answer", "question", "system", "model", "data", "result",
    "value", "method", "range", "level", "plan", "test", "early", "late",
]
# Words of at most four letters: one token each for real tokenizers' vocabularies and for the
# twin's approximation (one token per four characters of a word), so a prompt built without a
# tokenizer has the length asked for on the twin, and about it on vLLM.
_SHORT_WORDS = [w for w in _WORDS if len(w) <= 4]

APPROXIMATION = "1 token per common English word; file texts: 1 token per 4 characters"
# File records whose tokens a load generator counts before the run when it does not know how many
# requests it will send (a run with a duration): more are counted as they are needed.
PRECOUNTED = 4096


class WorkloadError(ValueError):
    """A workload file or tokenizer the load cannot be built from; one sentence naming it."""


@dataclass
class Turn:
    """One user turn: its text, its intended prompt tokens and the output tokens asked for."""

    text: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class RequestSpec:
    """One request (or conversation of several turns) derived from (seed, index)."""

    index: int
    turns: list[Turn]
    system: str | None = None
    ignore_eos: bool = True
    meta: dict = field(default_factory=dict)
    priority: int = 0


def sample_lengths(spec: Lengths, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
    """Draw token lengths from a distribution, rounded and clipped to [min, max]."""
    size = 1 if n is None else n
    if spec.dist == "fixed":
        x = np.full(size, spec.mean)
    elif spec.dist == "uniform":
        x = rng.uniform(spec.min, spec.max + 1, size)
    elif spec.dist == "normal":
        x = rng.normal(spec.mean, spec.std, size)
    else:
        # Parameterised by the wanted mean and std, not by the underlying normal's.
        sigma2 = math.log(1 + (spec.std / spec.mean) ** 2)
        mu = math.log(spec.mean) - sigma2 / 2
        x = rng.lognormal(mu, math.sqrt(sigma2), size)
    out = np.clip(np.floor(x) if spec.dist == "uniform" else np.rint(x), spec.min, spec.max)
    return out.astype(int)


def request_rng(seed: int, index: int, turn: int = 0) -> np.random.Generator:
    """The random stream of one request's turn: its lengths, then its text. The predictor draws
    request ``index``'s lengths from the same stream, so it serves the live run's own requests."""
    return np.random.default_rng([seed, 0, index, turn])


def priority_of(priorities: dict[int, float] | None, seed: int, index: int) -> int:
    """Request ``index``'s priority under a workload's ``priorities`` (0 without): drawn from a
    stream of its own, so its lengths are those of the same workload without priorities, and the
    predictor gives it the same one."""
    if not priorities:
        return 0
    values = sorted(priorities)
    u = np.random.default_rng([seed, 9, index]).random()
    return int(values[min(int(np.searchsorted(np.cumsum([priorities[v] for v in values]), u,
                                                 side="right")), len(values) - 1)])


def shared_prefix_length(ratio: float, mean_input: float) -> int:
    """The tokens of the system prompt a workload's requests share (0: none): its share of the
    mean prompt, one token at least. The live load builds it so and the predictor counts it so."""
    return max(1, round(ratio * mean_input)) if ratio > 0 else 0


def drawn_lengths(in_lengths: Lengths, out_lengths: Lengths, rng: np.random.Generator) -> tuple[int, int]:
    """A turn's (prompt, output) tokens, drawn from its stream in the order the live load draws
    them (the prompt first)."""
    return int(sample_lengths(in_lengths, rng)[0]), int(sample_lengths(out_lengths, rng)[0])


class PromptBuilder:
    """Builds text of a target token count, exact with a tokenizer.json, else by approximation."""

    def __init__(self, tokenizer_dir: Path | None = None):
        self.tokenizer = None
        self.approximation: str | None = APPROXIMATION
        if tokenizer_dir is not None:
            path = Path(tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"workload.tokenizer: {path} does not exist")
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_str(read_text(path, CONFIG_BYTES * 64, "tokenizer"))
            except InputError as e:
                raise WorkloadError(f"workload.tokenizer: {e}") from None
            except Exception as e:  # noqa: BLE001  the tokenizers library raises a bare Exception
                raise WorkloadError(f"workload.tokenizer: {path}: not a tokenizer.json the "
                                    f"tokenizers library can read ({str(e)[:120]})") from None
            self.approximation = None

    def count(self, text: str) -> int:
        """Count the tokens of a text (exact with a tokenizer, else ~4 characters a token)."""
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return max(1, round(len(text) / 4))

    @cached_property
    def words(self) -> np.ndarray | None:
        """The common words this tokenizer counts as one token each, alone and after a space, if
        text made of them always holds exactly as many tokens as words; else None.

        Found on first use (a builder made only to read ``approximation`` does not pay for it).
        A prompt of them is then built exactly with no tokenizer call. Encoding and trimming
        costs milliseconds a prompt, and a load generator builds prompts between requests in the
        loop that times every other stream: on a 16-core host that held each closed-loop user
        back 10 ms (30 ms at p90) before its next send, where vllm bench serve takes 1 ms.
        """
        if self.tokenizer is None:
            return None

        def one(text: str) -> bool:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids) == 1

        words = np.array([w for w in _WORDS if one(w) and one(" " + w)])
        if len(words) < 16:
            return None
        rng = np.random.default_rng(0)
        # Merges across a space (some vocabularies hold "of the") would break the count: check.
        if any(self.count(" ".join(rng.choice(words, n))) != n for n in (1, 2, 9, 64, 512)):
            return None
        return words

    def build(self, n_tokens: int, rng: np.random.Generator) -> str:
        """Return random text of about n_tokens tokens (within 5% with a tokenizer)."""
        n_tokens = max(1, int(n_tokens))
        if self.tokenizer is None:
            return " ".join(rng.choice(_SHORT_WORDS, n_tokens))
        if self.words is not None:
            return " ".join(rng.choice(self.words, n_tokens))
        words = " ".join(rng.choice(_WORDS, int(n_tokens * 1.3) + 8))
        ids = self.tokenizer.encode(words, add_special_tokens=False).ids
        while len(ids) < n_tokens:
            ids = ids + ids
        take = n_tokens
        text = self.tokenizer.decode(ids[:take])
        # Decoding a slice and re-encoding can merge or split at the edges; nudge the slice.
        for _ in range(4):
            got = self.count(text)
            if got == n_tokens:
                break
            take = max(1, take + (n_tokens - got))
            text = self.tokenizer.decode(ids[:take])
        return text


def _read(path: Path) -> str:
    try:
        return read_text(path, DATA_BYTES, "workload file")
    except InputError as e:
        raise WorkloadError(f"workload.path: {e}") from None


def _not_json(error: ValueError) -> str:
    """Why json could not read a file or line, in the user's terms (not Python's advice)."""
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON ({error.msg} at character {error.pos + 1})"
    if isinstance(error, InputError):  # nested past reading
        return "nested too deeply to read"
    # The one other ValueError json raises: an integer past Python's digit limit.
    return f"a number of more than {MAX_INT_DIGITS:,} digits"


def _load_sharegpt(path: Path) -> list[tuple[str, str | None]]:
    """A ShareGPT-format file's first two turns of each conversation (the prompt, the reply)."""
    text = _read(path)
    try:
        data = load_json(text, str(path))
    except ValueError as e:  # a truncated or broken file, or one nested past reading
        raise WorkloadError(f"workload.path: {path}: not a ShareGPT JSON file ({_not_json(e)}); "
                            f"it is a JSON list of conversations of text turns") from None
    if not isinstance(data, list):
        raise WorkloadError(f"workload.path: {path}: a ShareGPT file is a JSON list of "
                            f"conversations, not a {type(data).__name__}")
    pairs = []
    for item in data:
        if not isinstance(item, dict):
            continue
        conv = item.get("conversations") or item.get("conversation")
        if not isinstance(conv, list) or len(conv) < 2 or not all(isinstance(c, dict)
                                                                  for c in conv[:2]):
            continue
        prompt, reply = conv[0].get("value"), conv[1].get("value")
        if isinstance(prompt, str) and prompt and isinstance(reply, (str, type(None))):
            pairs.append((prompt, reply or ""))
    if not pairs:
        raise WorkloadError(f"workload.path: {path} holds no conversations with two turns of text")
    return pairs


# What a line of a JSONL prompt file is, as its errors say it.
_JSONL_LINE = (f"each line is an object with a 'prompt' (text) and an optional 'output_tokens' "
               f"(a whole number from 1 to {MAX_TOKENS:,})")


def _load_jsonl(path: Path) -> list[tuple[str, int | None]]:
    """A JSONL file's prompts, one JSON object a line: "prompt" (text), "output_tokens" (optional)."""
    rows = []
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = load_json(line, f"{path} line {n}")
        except ValueError as e:
            raise WorkloadError(f"workload.path: {path} line {n}: {_not_json(e)}; "
                                f"{_JSONL_LINE}") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise WorkloadError(f"workload.path: {path} line {n} has no 'prompt' key ({_JSONL_LINE})")
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"workload.path: {path} line {n}: 'prompt' must be text, not "
                                f"{shown(prompt)}")
        out = obj.get("output_tokens")
        if out is not None and (isinstance(out, bool) or not isinstance(out, int)
                                or not 1 <= out <= MAX_TOKENS):
            raise WorkloadError(f"workload.path: {path} line {n}: 'output_tokens' must be a whole "
                                f"number from 1 to {MAX_TOKENS:,} (past any model's context), "
                                f"not {_shown_number(out)}")
        rows.append((prompt, out))
    if not rows:
        raise WorkloadError(f"workload.path: {path} holds no prompts")
    return rows


def _shown_number(value) -> str:
    """A value as an error shows it; a long integer by its digits (Python prints none past 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a number of about {int(value.bit_length() * 0.30103):,} digits"
    return shown(value)


def check_workload(workload: Workload, load=None) -> None:
    """Build what the load generators will build from ``workload`` (its file's records, its
    tokenizer, its trace, the first request), so a file the load cannot be made of is one
    sentence before any server starts (WorkloadError, or the trace's TraceError), not a run
    whose load generator fails."""
    if workload.source in ("sharegpt-file", "jsonl-file", "trace") or workload.tokenizer:
        WorkloadGenerator(workload, 0, load).prepare(upto=1).request(0)


class WorkloadGenerator:
    """Turns (workload, seed) into `RequestSpec`s; `request(i)` depends only on seed and i.

    A trace's request i is its i-th (within ``load``'s replay window): its lengths, and its prompt
    built so that requests sharing Mooncake hash ids share those blocks' text, and requests of one
    prefix_id their prefix, word for word (so the prefix cache meets what production did).
    """

    def __init__(self, workload: Workload, seed: int = 0, load=None):
        self.workload = workload
        self.load = load
        self.seed = int(seed)
        self.builder = PromptBuilder(workload.tokenizer)
        self.in_lengths, self.out_lengths = workload.lengths()
        self.ignore_eos = workload.fixes_output()
        self._counts: dict[int, list] = {}  # file record -> [text tokens, output tokens]
        self._shared: dict[tuple, tuple[int, list]] = {}  # trace block or prefix -> (n, words)

    @cached_property
    def _records(self) -> list:
        w = self.workload
        if w.source == "sharegpt-file":
            recs = _load_sharegpt(w.path)
        elif w.source == "jsonl-file":
            recs = _load_jsonl(w.path)
        else:
            return []
        if not w.shuffle:
            return recs
        # A seeded permutation: file order does not leak into the sequence, the seed decides.
        perm = np.random.default_rng([self.seed, 7]).permutation(len(recs))
        return [recs[k] for k in perm]

    def _mean_input(self) -> float:
        if self.in_lengths is not None:
            return self.in_lengths.mean
        texts = [r[0] for r in self._records[:200]]
        return float(np.mean([self.builder.count(t) for t in texts]))

    @cached_property
    def _prefix_length(self) -> int:
        """The tokens each shared system prompt is built with (0: none is shared)."""
        ratio = self.workload.shared_prefix_ratio
        return shared_prefix_length(ratio, self._mean_input()) if ratio > 0 else 0

    @cached_property
    def _prefixes(self) -> list[str]:
        n = self._prefix_length
        if not n:
            return []
        return [
            self.builder.build(n, np.random.default_rng([self.seed, 1, g]))
            for g in range(self.workload.prefix_groups)
        ]

    @cached_property
    def _trace(self) -> tuple:
        if self.workload.source != "trace":
            return ()
        from vllm_lab.traffic.traces import trace_requests

        return trace_requests(self.workload, self.load)

    def _shared_text(self, key: tuple, n: int) -> str:
        """The first n tokens of a text that is the same wherever ``key`` (a block's hash id, a
        prefix id) recurs, in every process (seeded by a stable hash of the key, not Python's)."""
        got = self._shared.get(key)
        if got is None or got[0] < n:
            seed = [self.seed, 3, zlib.crc32(repr(key).encode())]
            words = self.builder.build(n, np.random.default_rng(seed)).split(" ")
            got = self._shared[key] = (n, words)
        return " ".join(got[1][:n])

    def _trace_turn(self, i: int) -> Turn:
        r = self._trace[i % len(self._trace)]
        if r.blocks:
            from vllm_lab.traffic.traces import MOONCAKE_BLOCK_TOKENS as B

            # Each block is its hash id's 512 tokens; the last one is cut to the prompt's length.
            parts, left = [], r.prompt_tokens
            for h in r.blocks:
                if left <= 0:
                    break
                self._shared_text(("block", h), B)  # built whole, so a cut one is its beginning
                parts.append(self._shared_text(("block", h), min(B, left)))
                left -= B
            text = " ".join(parts)
        elif r.prefix is not None and r.prefix_tokens:
            rest = r.prompt_tokens - r.prefix_tokens
            rng = np.random.default_rng([self.seed, 4, i])
            text = self._shared_text(("prefix", r.prefix), r.prefix_tokens)
            text = text + " " + self.builder.build(rest, rng) if rest else text
        else:
            text = self.builder.build(r.prompt_tokens, np.random.default_rng([self.seed, 4, i]))
        return Turn(text, r.prompt_tokens, r.output_tokens)

    def prepare(self, upto: int | None = None) -> WorkloadGenerator:
        """Build what every request shares (file records, shared prefixes) now, not on first use,
        and count the tokens of the file records the first ``upto`` requests use (default: the
        first PRECOUNTED).

        A load generator calls it before its measured window opens, so the first request's send is
        not held up by work that belongs to the whole run, and a request from a file costs no
        tokenizer call between a reply and the next send (a few ms each, in the loop that times
        every other stream).
        """
        _ = self._records, self._prefixes, self._prefix_tokens, self.builder.words, self._trace
        if self._records and self.builder.tokenizer is not None:
            n = min(len(self._records), (upto or PRECOUNTED) * self.workload.turns)
            todo = [k for k in range(n) if k not in self._counts]
            texts = [self._records[k][0] for k in todo]
            outs = [k for k in todo if isinstance(self._records[k][1], str)]
            enc = self.builder.tokenizer.encode_batch
            for k, e in zip(todo, enc(texts, add_special_tokens=False)):
                self._counts[k] = [len(e.ids), self._records[k][1]]
            for k, e in zip(outs, enc([self._records[k][1] for k in outs], add_special_tokens=False)):
                self._counts[k][1] = len(e.ids)
        return self

    def _record(self, k: int) -> tuple[str, int, int | None]:
        """File record ``k``: its text, the text's tokens and its output tokens (a reply's count,
        the file's number, or None), counted once."""
        text, out = self._records[k]
        if k not in self._counts:
            self._counts[k] = [self.builder.count(text),
                               self.builder.count(out) if isinstance(out, str) else out]
        n_in, n_out = self._counts[k]
        return text, n_in, n_out

    @cached_property
    def _prefix_tokens(self) -> int:
        # Counted once: with a tokenizer, counting a long prefix per request costs milliseconds.
        # Without one it is built of words one token each: its length exactly, where counting
        # ~4 characters a token would read 52 for 49 and shorten every prompt by the difference.
        if self.builder.tokenizer is None:
            return self._prefix_length
        return self.builder.count(self._prefixes[0]) if self._prefixes else 0

    def _turn(self, i: int, t: int) -> Turn:
        rng = request_rng(self.seed, i, t)
        prefix_tokens = self._prefix_tokens
        if self._records:
            text, n_in, out = self._record((i * self.workload.turns + t) % len(self._records))
            if out is None or self.out_lengths is not None:
                out = int(sample_lengths(self.out_lengths, rng)[0]) if self.out_lengths else 256
            return Turn(text, n_in, max(1, int(out)))
        n_in, n_out = drawn_lengths(self.in_lengths, self.out_lengths, rng)
        user_tokens = max(1, n_in - prefix_tokens)
        return Turn(self.builder.build(user_tokens, rng), user_tokens, n_out)

    def request(self, i: int) -> RequestSpec:
        """Return request (conversation) number i; the same (seed, i) always gives the same one."""
        priority = priority_of(self.workload.priorities, self.seed, i)
        if self._trace:
            return RequestSpec(index=i, turns=[self._trace_turn(i)], ignore_eos=self.ignore_eos,
                               priority=priority)
        turns = [self._turn(i, t) for t in range(self.workload.turns)]
        system = self._prefixes[i % len(self._prefixes)] if self._prefixes else None
        return RequestSpec(index=i, turns=turns, system=system, ignore_eos=self.ignore_eos,
                           priority=priority)

    def body(self, spec: RequestSpec, model: str, turn: int = 0, history: list | None = None):
        """Return (path, JSON body) of one streamed OpenAI request for a turn of a request."""
        w, t = self.workload, spec.turns[turn]
        common = {
            "model": model,
            "max_tokens": t.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if w.temperature is not None:
            common["temperature"] = w.temperature
        if spec.ignore_eos:
            # vLLM's own extension, as vllm bench serve sends it. No min_tokens beside it: a server
            # that honours one honours both, and vLLM runs a logits processor for every running
            # request that has min_tokens, a Python pass over them each step (one more
            # difference from the reference client's requests, for nothing).
            common["ignore_eos"] = True
        if spec.priority:
            common["priority"] = spec.priority  # vLLM's extension; 0 is its default
        if w.api == "completions":
            prompt = t.text if spec.system is None else spec.system + "\n" + t.text
            return "/v1/completions", {**common, "prompt": prompt}
        messages = [{"role": "system", "content": spec.system}] if spec.system else []
        messages += list(history or []) + [{"role": "user", "content": t.text}]
        return "/v1/chat/completions", {**common, "messages": messages}
