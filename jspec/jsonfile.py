"""Reading a JSON file a user pointed us at: a missing, unreadable or malformed file becomes one
ValueError that names what the file was for, never a traceback."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str | os.PathLike, what: str) -> Any:
    """The parsed contents of ``path``; ``what`` names the file in errors ("policy state")."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not JSON ({e.msg})") from None
