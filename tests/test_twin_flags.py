"""The flag catalog is the twin's one source of defaults, and says which flags the twin models."""

from __future__ import annotations

from vllm_lab import flags as flag_catalog
from vllm_lab.analysis import findings
from vllm_lab.twin.cli_args import SERVER_FLAGS, build_parser
from vllm_lab.twin.engine import ENGINE_FLAGS, resolve_flags
from vllm_lab.twin.profile import load_profile


def _parser_flags() -> set[str]:
    twin_only = {"config", "twin-profile", "twin-startup-seconds", "twin-fault", "help"}
    names = set()
    for action in build_parser()._actions:  # argparse keeps no public list of options
        for opt in action.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-"):
                names.add(opt[2:])
    return names - twin_only


def test_every_accepted_flag_is_modelled_or_marked():
    """A flag the twin accepts is either read by its engine or server, or marked not modelled."""
    accepted = _parser_flags()
    assert accepted == set(flag_catalog.FLAGS)
    honoured = ENGINE_FLAGS | SERVER_FLAGS
    for name in accepted:
        flag = flag_catalog.FLAGS[name]
        assert flag.twin_models == (name in honoured), (
            f"{name}: twin_models={flag.twin_models} but the twin "
            f"{'reads' if name in honoured else 'ignores'} it")
        assert (flag_catalog.twin_note(name) is None) == flag.twin_models


def test_defaults_come_from_the_catalog():
    """The engine, the findings and the catalog agree on vLLM 0.26's defaults."""
    from vllm_lab.models import load_model_shape

    h200 = load_profile("h200-llama-3-8b")
    cfg = resolve_flags({}, h200, load_model_shape("llama-3-8b"))
    large = flag_catalog.engine_defaults(h200.hardware.memory_gib, h200.hardware.name)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (1024, 8192)
    assert cfg.max_num_seqs == large["max-num-seqs"]
    assert cfg.gpu_memory_utilization == flag_catalog.default("gpu-memory-utilization") == 0.92
    assert cfg.block_size == flag_catalog.default("block-size")
    small = flag_catalog.engine_defaults(79.3, "NVIDIA A100 80GB")
    assert (small["max-num-seqs"], small["max-num-batched-tokens"]) == (256, 2048)
    for name, value in findings.VLLM_DEFAULTS.items():
        assert value == large[name] if name in large else flag_catalog.default(name)
