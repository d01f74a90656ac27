"""Speculative decoding's configuration against checkpoints: the cache groups of the target
and its drafter, the draft checkpoint's config, and the checks ``serve`` runs before any
process starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rackserve.config import ConfigError, ModelConfig, SpecConfig
from rackserve.kv.spec import CacheGroupSpec, cache_groups_for
from rackserve.model.loader import check_checkpoint, checkpoint_files, open_shards

DRAFT_PREFIX = "draft_"  # the draft model's cache groups in the shared KV manager


def draft_cache_groups(
    cfg: ModelConfig, dtype_bytes: int, state_dtype_bytes: int | None = None
) -> list[CacheGroupSpec]:
    """The draft model's cache groups, named with :data:`DRAFT_PREFIX`."""
    groups = cache_groups_for(cfg, dtype_bytes, state_dtype_bytes)
    return [replace(g, name=DRAFT_PREFIX + g.name) for g in groups]


def spec_cache_groups(
    spec: SpecConfig | None,
    cfg: ModelConfig,
    dtype_bytes: int,
    state_dtype_bytes: int | None = None,
) -> list[CacheGroupSpec]:
    """Every cache group of the target and its drafter, the target's first (MTP: its
    layer rides in the target's ``swa`` group as layer ``num_hidden_layers``).
    ``dtype_bytes``: KV elements; ``state_dtype_bytes``: compressor rows (default same)."""
    num_mtp = 1 if spec is not None and spec.method == "mtp" else 0
    groups = cache_groups_for(cfg, dtype_bytes, state_dtype_bytes, num_mtp_layers=num_mtp)
    if spec is not None and spec.method == "draft_model":
        groups += draft_cache_groups(draft_config(spec, cfg), dtype_bytes, state_dtype_bytes)
    return groups


def draft_config(spec: SpecConfig, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's config, checked against the target's (ConfigError)."""
    assert spec.model is not None
    path = Path(spec.model)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--speculative-config: draft model {spec.model!r} has no config.json; give a "
            "checkpoint directory (e.g. one written by `rackserve model create`)"
        )
    cfg = ModelConfig.from_pretrained(path)
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft's vocabulary ({cfg.vocab_size}) differs from "
            f"the target's ({target.vocab_size}); the draft must share the tokenizer"
        )
    return cfg


def check_spec_checkpoint(spec: SpecConfig | None, model_dir: str | Path) -> None:
    """ConfigError/CheckpointError naming the fix unless ``spec`` can run on the target at
    ``model_dir`` (reads headers and configs only: ``serve`` checks before any process)."""
    if spec is None:
        return
    target = ModelConfig.from_pretrained(model_dir)
    if spec.method == "mtp":
        names = open_shards(checkpoint_files(Path(model_dir)))
        if not any(name.startswith("mtp.") for _, name in names):
            raise ConfigError(NO_MTP)
        return
    draft_config(spec, target)
    assert spec.model is not None
    check_checkpoint(spec.model)


NO_MTP = (
    '--speculative-config: method "mtp" needs the checkpoint\'s MTP layer, and this one has '
    'no mtp.* weights; use method "draft_model" with a draft checkpoint'
)
