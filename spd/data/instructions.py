"""Coding instructions made from the Python standard library's own source, for regenerating chat data.

A head must predict what its target says, so its training data are the target's answers to prompts
(``spd.data.regenerate``). The prompts here ship with every Python: each public, documented function of the
standard library (read with :mod:`ast`, nothing is imported or run) becomes a request to write or explain
a function that does what its docstring says. They share nothing with HumanEval's problems, which are
the benchmark's hold-out set.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

# Request shapes, drawn per function; {sig} is the function's signature, {what} the docstring's first sentence.
_TEMPLATES = (
    "Write a Python function `{sig}` that {what}",
    "Implement `{sig}` in Python: it {what} Include a docstring.",
    "Write a Python function that {what} Explain your code briefly.",
    "How would you write `{sig}` in Python? It {what}",
    "Explain what the function `{module}.{name}` from Python's standard library does ({what_bare}), and show a "
    "short example of using it.",
    "Write a small Python program that uses `{module}.{name}` and explain what it prints.",
)


# First words of docstrings that are not a verb ("The SSLContext that ..."): such functions are skipped.
_NOT_VERBS = {
    "a",
    "an",
    "the",
    "this",
    "these",
    "that",
    "if",
    "when",
    "for",
    "in",
    "on",
    "as",
    "it",
    "its",
    "note",
    "see",
    "deprecated",
    "internal",
    "private",
    "helper",
    "used",
    "called",
    "default",
    "same",
    "like",
    "alias",
    "obsolete",
    "undocumented",
    "no",
    "not",
    "only",
    "all",
    "any",
    "each",
    "one",
    "two",
    "new",
}


def _first_sentence(doc: str) -> str | None:
    """The docstring's first sentence, as a lower-case clause ending in a period, or None if unusable."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = para.split(". ")[0].rstrip(".").strip()
    if not 12 <= len(sentence) <= 200 or not sentence[0].isalpha() or "`" in sentence or ">>>" in sentence:
        return None
    first = sentence.split()[0]
    # Docstrings start with a verb in the third person ("Return ...") or the imperative; make it a clause.
    if not first[0].isupper() or not first.isalpha() or first.lower() in _NOT_VERBS:
        return None
    verb = first.lower()
    if not verb.endswith("s"):
        verb = verb + ("es" if verb.endswith(("sh", "ch", "x", "o")) else "s")
    return f"{verb}{sentence[len(first) :]}."


def _signature(node: ast.FunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def stdlib_functions(stdlib: Path | None = None) -> list[dict]:
    """Public documented functions and methods of the standard library: module, name, signature, clause."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(
            part in ("test", "tests", "idlelib", "site-packages", "lib2to3") or part.startswith("_")
            for part in rel.parts[:-1]
        ) or rel.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        # Top-level functions, and the methods of top-level public classes (as Class.method).
        candidates = [("", node) for node in tree.body]
        candidates += [
            (f"{cls.name}.", node)
            for cls in tree.body
            if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_")
            for node in cls.body
        ]
        for prefix, node in candidates:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                what = _first_sentence(doc) if doc else None
                if what:
                    found.append({"module": module, "name": prefix + node.name, "sig": _signature(node), "what": what})
    return found


def stdlib_instructions(count: int | None = None, seed: int = 0, stdlib: Path | None = None) -> list[dict]:
    """Instructions ``{"id", "prompt", "module", "name"}``, one per function, shuffled with ``seed``."""
    rng = random.Random(seed)
    functions = list({f"{fn['module']}.{fn['name']}": fn for fn in stdlib_functions(stdlib)}.values())
    rng.shuffle(functions)
    out = []
    for fn in functions[:count] if count else functions:
        template = rng.choice(_TEMPLATES)
        prompt = template.format(
            sig=fn["sig"], what=fn["what"], what_bare=fn["what"].rstrip("."), module=fn["module"], name=fn["name"]
        )
        out.append({"id": f"{fn['module']}.{fn['name']}", "prompt": prompt, "module": fn["module"], "name": fn["name"]})
    return out
