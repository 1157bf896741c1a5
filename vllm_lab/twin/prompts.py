"""A request's prompt as the twin's predictor takes it: token ids that share the prefixes a
workload shares (what vLLM's prefix cache meets), and the tokens the served model's chat template
puts around a message. The lab's prediction layer builds a scenario's requests from these, and the
twin's reference readings the measured runs' requests, so a replayed run and a predicted one are
the same requests."""

from __future__ import annotations

from functools import lru_cache


def shared_prefix_prompts(prompts, shared: int, groups: int, template: int = 0) -> list:
    """Prompts of these lengths as the predictor takes them, each ``template`` tokens longer (the
    chat template the server wraps a message in): request i opening with prefix i mod ``groups``
    of ``shared`` tokens, as the live workload builds them (`WorkloadGenerator._turn`: the drawn
    length is the whole prompt, prefix included, the user's text the rest, at least one token);
    plain lengths where nothing is shared."""
    prompts = [int(p) + template for p in prompts]
    if not shared:
        return prompts
    # Token ids only matter for prefix caching: a common system prompt, then unique tokens.
    prefix = [list(range(1_000_000 * (g + 1), 1_000_000 * (g + 1) + shared)) for g in range(groups)]
    out = []
    for i, p in enumerate(prompts):
        rest = max(1, p - shared)
        out.append(prefix[i % groups]
                   + list(range(10_000_000 + i * 100_000, 10_000_000 + i * 100_000 + rest)))
    return out


@lru_cache(maxsize=32)
def template_tokens(tokenizer: str, chat_template: str | None, system: bool) -> int:
    """The tokens a chat template puts around one user message (the start, the role headers, the
    end-of-turn and the assistant's header), and around a system message where there is one:
    about 10 for Llama-3's (15 with a system message), counted with the model folder's own
    template and tokenizer, or the twin's when it has none."""
    from vllm_lab.twin.tokenizer import load_tokenizer  # jinja2: only where a chat run asks

    messages = [{"role": "system", "content": ""}] if system else []
    return len(load_tokenizer(tokenizer, chat_template=chat_template)
               .encode_chat([*messages, {"role": "user", "content": ""}]))
