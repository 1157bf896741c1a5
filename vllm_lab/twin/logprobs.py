"""Synthetic logprobs in vLLM's shapes (completions and chat): deterministic, plausible numbers,
the sampled token the likeliest of its top k; the text is the twin's pseudo-words."""

from __future__ import annotations

from vllm_lab.twin.tokenizer import pseudo_word


def _lp(token_id: int, position: int, rank: int) -> float:
    # Deterministic, plausible numbers: the sampled token near 0, each next rank lower.
    return -round(((token_id * 2654435761 + position * 40503) % 997) / 997 * 1.5 + rank * 1.25, 4)


def _top(word: str, token_id: int, position: int, rank: int) -> tuple[str, float]:
    return (word if rank == 0 else pseudo_word(token_id + rank, position + 7 * rank),
            _lp(token_id, position, rank))


def shaped(entries: list[tuple[str, int, int, bool]], k: int, chat: bool, offset: int) -> dict:
    """The logprobs of ``entries`` (word, token id, position, scored) with ``k`` top tokens each:
    chat's ``content`` list, or completions' parallel lists from text ``offset``."""
    if chat:
        content = []
        for word, t, pos, _scored in entries:
            tops = [_top(word, t, pos, j) for j in range(k)]
            content.append({"token": word, "logprob": tops[0][1] if tops else _lp(t, pos, 0),
                            "bytes": list(word.encode()),
                            "top_logprobs": [{"token": w, "logprob": lp,
                                              "bytes": list(w.encode())} for w, lp in tops]})
        return {"content": content}
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                            "top_logprobs": []}
    for word, t, pos, scored in entries:
        out["text_offset"].append(offset)
        offset += len(word)
        out["tokens"].append(word)
        if not scored:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        tops = [_top(word, t, pos, j) for j in range(max(k, 1))]
        out["token_logprobs"].append(tops[0][1])
        out["top_logprobs"].append(dict(tops))
    return out
