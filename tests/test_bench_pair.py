"""`jspec bench pair`: held-out function prompts, the parse check, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json

from jspec.bench import pair
from jspec.models.corpus import SourceFile, function_prompts

SOURCE = '''
import os


def top(a, b=2):
    """Add.

    More words.
    """
    return a + b


class K:
    def method(self):
        """One line."""
        return 1

    def undocumented(self):
        return 2
'''


def test_function_prompts_cut_after_the_docstring(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    prompts = function_prompts([SourceFile(str(path), "mod.py", "mod")])
    assert prompts == ['def top(a, b=2):\n    """Add.\n\n    More words.\n    """\n',
                       'def method(self):\n    """One line."""\n']
    assert function_prompts([SourceFile(str(path), "mod.py", "mod")], max_chars=50) == [
        prompts[1]]


def test_function_body_parses():
    p = 'def f(x):\n    """doc"""\n'
    assert pair.function_body_parses(p, "    return x + 1\n\ndef g():\n")
    assert pair.function_body_parses(p, "    y = 1\n    return y +")  # budget cut: last line
    assert not pair.function_body_parses(p, "    return (x +\n")
    assert not pair.function_body_parses(p, "\ndef g")  # no body at all
    assert not pair.function_body_parses(p, "  )))\n")


def test_tiny_pair_end_to_end(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    parser = argparse.ArgumentParser()
    pair.add_arguments(parser)
    out = tmp_path / "pair.json"
    args = parser.parse_args(["--target", str(target), "--draft", str(draft), "--num-prompts",
                              "2", "--max-tokens", "6", "--max-num-seqs", "2", "--no-cost",
                              "--show", "1", "--json", str(out)])
    assert pair.run(args) == 0
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 2 and data["gamma"] == 4 and data["tokens"] == 12
    assert 0.0 <= data["acceptance_rate"] <= 1.0 and len(data["acceptance_by_position"]) == 4
    assert "held-out prompts, greedy" in capsys.readouterr().out
