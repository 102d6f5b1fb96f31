"""The template registry when a user registers templates of their own.

The built-in families are registered lazily, on the first lookup. Each case runs in a fresh Python
process: the registry is module-level state, and the test session has long since done its first
lookup, so only a new process shows what happens when ``register_template`` comes first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it ends by printing one JSON object, returned here."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def builtin_names() -> list[str]:
    return run_fresh("import json; from registries.templates import list_templates; print(json.dumps(list_templates()))")


def test_registering_a_builtin_name_before_the_first_lookup_fails_at_that_call():
    result = run_fresh(
        """
import json
from registries.templates import get_template, list_templates, register_template

out = {}
try:
    mine = register_template("chatml", user=["USER {{content}}"])
    out["register"] = "no error"
except ValueError as e:
    out["register"] = str(e)
try:
    chatml = get_template("chatml")
    out["chatml_user_slots"] = list(chatml.format_user.slots)
    out["qwen"] = get_template("qwen").name
    out["names"] = list_templates()
except Exception as e:
    out["lookup"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""
    )
    assert result["register"] == "Template 'chatml' is already registered."
    assert "lookup" not in result, result["lookup"]  # lookups after the refused registration still work
    assert result["chatml_user_slots"] == ["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]
    assert result["qwen"] == "qwen"
    assert result["names"] == builtin_names()


def test_a_new_name_registered_before_the_first_lookup_is_listed_with_every_builtin():
    result = run_fresh(
        """
import json
from registries.templates import get_template, list_templates, register_template

register_template("my_format", user=["Q: {{content}}\\nA: "], stop_words=["Q:"])
out = {"names": list_templates(), "mine": get_template("my_format").name}
try:
    register_template("my_format")
    out["again"] = "no error"
except ValueError as e:
    out["again"] = str(e)
print(json.dumps(out))
"""
    )
    builtins = builtin_names()
    assert "my_format" not in builtins and len(builtins) > 10
    assert result["names"] == sorted([*builtins, "my_format"])
    assert result["mine"] == "my_format"
    assert result["again"] == "Template 'my_format' is already registered."


def test_registering_a_builtin_name_after_a_lookup_fails_too():
    result = run_fresh(
        """
import json
from registries.templates import list_templates, register_template

before = list_templates()
try:
    register_template("qwen")
    error = "no error"
except ValueError as e:
    error = str(e)
print(json.dumps({"error": error, "unchanged": list_templates() == before}))
"""
    )
    assert result == {"error": "Template 'qwen' is already registered.", "unchanged": True}
