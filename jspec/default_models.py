"""The built-in default model pair used when no model is given.

Until the trained default pair ships in the repository, the default is a tiny random pair built
by our own code on first use (no download) and cached on disk; it exercises every code path but
its draft agrees with its target only by chance.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("JSPEC_CACHE") or os.path.join(Path.home(), ".cache", "jspec")
    return Path(root)


def default_pair() -> tuple[str, str]:
    """(target_dir, draft_dir) of the default pair, building it if needed."""
    from models.tiny import write_tiny_pair

    root = cache_dir() / "tiny-random-pair-v1"
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        target_path, draft_path = write_tiny_pair(root, model_type="llama", seed=0)
        return str(target_path), str(draft_path)
    return str(target), str(draft)
