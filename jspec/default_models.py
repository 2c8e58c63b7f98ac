"""The built-in default model pair used when no model is given.

The pair ships in the repository under ``models/default_pair/`` (``target`` and ``draft``, HF
checkpoints in bf16 safetensors with their tokenizer; trained on the CPython standard library by
``jspec train`` / ``jspec distill``, see the model card ``models/default_pair/README.md``). When
those files are missing (a stripped install), the default falls back to a tiny random pair built
by our own code on first use and cached on disk: it exercises every code path, but its draft
agrees with its target only by chance.
"""

from __future__ import annotations

import os
from pathlib import Path

import jspec.models

# in the jspec.models package: the repository's models/ folder, or jspec/models/ once installed
SHIPPED_DIR = Path(jspec.models.__file__).resolve().parent / "default_pair"


def cache_dir() -> Path:
    root = os.environ.get("JSPEC_CACHE") or os.path.join(Path.home(), ".cache", "jspec")
    return Path(root)


def shipped_pair() -> tuple[str, str] | None:
    """(target_dir, draft_dir) of the shipped trained pair, or None if it is not installed."""
    target, draft = SHIPPED_DIR / "target", SHIPPED_DIR / "draft"
    for d in (target, draft):
        if not (d / "config.json").exists() or not (d / "model.safetensors").exists():
            return None
    return str(target), str(draft)


def shipped_intermediate() -> str | None:
    """The shipped pool's middle model (``models/default_pair/mid``: between the draft and the
    target in size, for SpecRouter's chains), or None if it is not installed."""
    mid = SHIPPED_DIR / "mid"
    if (mid / "config.json").exists() and (mid / "model.safetensors").exists() \
            and shipped_pair() is not None:
        return str(mid)
    return None


def tiny_random_intermediate() -> str:
    """A tiny random middle model for the fallback pool (built on first use, cached)."""
    from jspec.models.tiny import write_tiny_checkpoint
    from jspec.models.train import TINY_INTERMEDIATE

    path = cache_dir() / "tiny-random-pair-v1" / "mid"
    if not (path / "config.json").exists():
        target, _ = tiny_random_pair()
        from jspec.models.loader import load_tokenizer

        write_tiny_checkpoint(path, "llama", seed=2, tokenizer=load_tokenizer(target),
                              **TINY_INTERMEDIATE)
    return str(path)


def default_head() -> str:
    """The built-in target's EAGLE-3 head (``models/default_pair/eagle3``, trained by ``jspec
    train-eagle``), or for the tiny random fallback target a random head, built on first use
    and cached."""
    head = SHIPPED_DIR / "eagle3"
    if shipped_pair() is not None:
        if not (head / "model.safetensors").exists():
            raise ValueError(f"the built-in target's EAGLE-3 head is not installed ({head}); "
                             "give one as the draft")
        return str(head)
    from jspec.models.config import ModelConfig
    from jspec.models.eagle_checkpoint import write_tiny_eagle

    target, _ = tiny_random_pair()
    path = cache_dir() / "tiny-random-pair-v1" / "eagle3"
    if not (path / "config.json").exists():
        write_tiny_eagle(path, ModelConfig.from_json_file(os.path.join(target, "config.json")),
                         seed=3)
    return str(path)


def default_pool() -> tuple[str, dict[str, str]]:
    """(target_dir, {name: dir}) of the built-in pool, smallest first: the draft and the middle
    model (``LLM(policy="specrouter")`` with no models given)."""
    target, draft = default_pair()
    mid = shipped_intermediate() if shipped_pair() is not None else tiny_random_intermediate()
    pool = {"draft": draft}
    if mid is not None:
        pool["mid"] = mid
    return target, pool


def tiny_random_pair() -> tuple[str, str]:
    """(target_dir, draft_dir) of the tiny random pair, building it if needed."""
    from jspec.models.tiny import write_tiny_pair

    root = cache_dir() / "tiny-random-pair-v1"
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        target_path, draft_path = write_tiny_pair(root, model_type="llama", seed=0)
        return str(target_path), str(draft_path)
    return str(target), str(draft)


def default_pair() -> tuple[str, str]:
    """(target_dir, draft_dir): the shipped pair, else the tiny random one."""
    return shipped_pair() or tiny_random_pair()


def describe_default_pair() -> str:
    if shipped_pair() is not None:
        return ("the built-in default pair (models/default_pair: a target and its distilled "
                "draft, trained on the CPython standard library)")
    return "the tiny random fallback pair (expect gibberish and low acceptance)"
