"""Model shapes: the numbers that decide a model's memory and compute, and offline model folders.

A shape comes from a model folder's ``config.json`` (what vLLM reads) or from a built-in name, so
the twin can serve "meta-llama/Meta-Llama-3-8B-Instruct" on a machine that has never seen its
weights. ``make_model_folder`` writes config + tokenizer only, which is all vLLM's
``--load-format dummy`` needs.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from vllm_lab.inputs import load_json, read_text

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1,
               "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer (Llama-style)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"

    @property
    def linear_params(self) -> int:
        """Parameters of the linear layers, all layers (attention projections, gated MLP): what a
        step multiplies each token by, and what a quantization method stores in fewer bytes."""
        attn = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn += self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def num_params(self) -> int:
        """Parameter count: attention + gated MLP per layer, embeddings and LM head."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + self.num_layers * 2 * self.hidden_size + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token takes across all layers (before tensor parallelism)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_config(self) -> dict:
        """The Hugging Face ``config.json`` of this shape (Llama architecture)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": self.torch_dtype,
            "bos_token_id": 0, "eos_token_id": 4, "tie_word_embeddings": self.tie_word_embeddings,
        }

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelShape:
        """Read a shape from a Hugging Face config dict."""
        heads = cfg["num_attention_heads"]
        return cls(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
        )


def _llama(name, layers, hidden, heads, kv, inter, vocab, ctx, tie=False) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv, hidden // heads, inter, vocab, ctx, tie)


# Shapes of public models the lab knows by name; any other model needs a folder with config.json.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
    "llama-2-7b": _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "qwen2.5-7b": _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768),
    "smollm-135m": _llama("smollm-135m", 30, 576, 9, 3, 1536, 49152, 8192, tie=True),
}
_ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/llama-3.1-8b": "llama-3-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b", "meta-llama/llama-3.1-70b-instruct": "llama-3-70b",
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "huggingfacetb/smollm-135m": "smollm-135m",
}


def load_model_shape(model: str) -> ModelShape:
    """Return the shape of ``model``: a folder with config.json, or a known name or alias (also as
    the last part of a path that is not here)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        config = load_json(read_text(path / "config.json", what="model config"), str(path))
        try:
            return ModelShape.from_config(path.name, config)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"model {model!r}: its config.json has no usable model shape "
                             f"({type(e).__name__}: {str(e)[:80]})") from None
    key = model.lower()
    # A model folder that is not on this machine (a run stored on the GPU host it ran on, read
    # here) is the shape its folder is named for, where that names one.
    key = (_ALIASES.get(key) or _ALIASES.get(path.name.lower())
           or (key if key in KNOWN_SHAPES else path.name.lower()))
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key]
    known = ", ".join(sorted(KNOWN_SHAPES))
    raise ValueError(f"model {model!r}: no folder with config.json there and not a known shape "
                     f"(known: {known})")


_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def make_model_folder(shape: ModelShape | str, out: Path, vocab_size: int = 32000) -> Path:
    """Write config.json and a byte-level BPE tokenizer for ``shape`` into ``out``.

    The tokenizer is trained on the Python standard library's sources, so a folder made here for
    the twin and one made on a GPU host for real vLLM (--load-format dummy) count prompt tokens
    alike.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shape = load_model_shape(shape) if isinstance(shape, str) else shape
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("**/*.py"))[:3000]

    def texts():
        for f in files:
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _SPECIAL[0], "eos_token": "<|eot_id|>",
        "model_max_length": shape.max_position_embeddings, "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}, indent=1))
    (out / "config.json").write_text(json.dumps(shape.to_config(), indent=1))
    return out
