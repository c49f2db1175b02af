"""Every relative link in the README, CONTRIBUTING, CHANGELOG and docs/ resolves: the file exists, and an ``#anchor``
names a heading of the page it points to (GitHub's slugs) or an explicit ``<a id>`` / ``<a name>``.

Links are inline (``[text](path#anchor)``, images too), reference definitions (``[label]: path``) and HTML
``href`` / ``src`` attributes. Links with a scheme (``https:``, ``mailto:``, ...) are not checked, nor anything in
fenced code blocks or inline code.

The docs stay light and their results accounted for: docs/results and docs/*.md stay under a size, every file under
docs/results is cited by a page (the README, docs/, a head's model card), and every result a page cites exists. No
model loads: the whole check reads text files.
"""

from __future__ import annotations

import html
import re
import sys
import unicodedata
from bisect import bisect_right
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import cache
from itertools import accumulate
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(
    {REPO / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md") if (REPO / name).is_file()}
    | set((REPO / "docs").rglob("*.md"))
)
MARKDOWN = (".md", ".markdown")

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_NOT_PARAGRAPH = re.compile(r"^\s*(?:[-*+] |\d+[.)] |>|\||#)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_EXPLICIT_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_HTML_LINK = re.compile(r"<(?:a|img|source)\s[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"'][^>]*>", re.IGNORECASE)
_REFERENCE = re.compile(r"^ {0,3}\[((?:[^\[\]\\]|\\.)+)\]:[ \t]*(<[^>\n]*>|\S+)")
_EMPHASIS = re.compile(r"(?<![\w*])(\*{1,3}|_{1,3})(?=\S)(.+?)(?<=\S)\1(?![\w*])")
_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")


# ----------------------------------------------------------------------------------------- GitHub's anchors


def slug(text: str) -> str:
    """GitHub's anchor for a heading's rendered text: lowercase; drop every character that is not a letter, digit,
    space, hyphen or underscore; each space becomes a hyphen."""
    kept = (
        c
        for c in text.strip().lower()
        if c in " -_" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    )
    return "".join(kept).replace(" ", "-")


class Slugger:
    """Slugs of one page's headings in order: a repeated slug gets ``-1``, ``-2``, ... (as github-slugger does)."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def slug(self, text: str) -> str:
        base = result = slug(text)
        while result in self.seen:
            self.seen[base] += 1
            result = f"{base}-{self.seen[base]}"
        self.seen[result] = 0
        return result


def heading_text(source: str) -> str:
    """The text a heading renders to: code spans keep their content, links their text, emphasis and HTML tags go."""
    spans: list[str] = []

    def keep(code: str, span: str) -> str:
        spans.append(code)
        return f"\0{len(spans) - 1}\0"

    text = strip_code(source, keep)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)  # an image renders no text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    previous = None
    while previous != text:
        previous, text = text, _EMPHASIS.sub(r"\2", text)
    text = html.unescape(_ESCAPE.sub(r"\1", text))
    return re.sub("\0(\\d+)\0", lambda m: spans[int(m.group(1))], text)


# ------------------------------------------------------------------------------------------- reading a page


def strip_code(text: str, replace=lambda code, span: "") -> str:
    """``text`` with each inline code span (a run of n backticks up to the next run of exactly n) replaced by
    ``replace(content, span)``; a run with no match stays as it is."""
    runs = list(re.finditer(r"`+", text))
    out, pos, i = [], 0, 0
    while i < len(runs):
        opening = runs[i]
        close = next((j for j in range(i + 1, len(runs)) if len(runs[j].group()) == len(opening.group())), None)
        if close is None:
            i += 1
            continue
        out.append(text[pos : opening.start()])
        out.append(replace(text[opening.end() : runs[close].start()], text[opening.start() : runs[close].end()]))
        pos, i = runs[close].end(), close + 1
    out.append(text[pos:])
    return "".join(out)


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif (
            fence is not None
            and match
            and match.group(1)[0] == fence[0]
            and len(match.group(1)) >= len(fence)
            and not line.strip()[len(match.group(1)) :].strip()
        ):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a page: its headings' slugs and its explicit ``<a id>`` / ``<a name>`` anchors."""
    slugger, found, previous = Slugger(), set(), None
    for number, line in prose_lines(path):
        found.update(_EXPLICIT_ANCHOR.findall(strip_code(line)))
        atx = _ATX.match(line)
        setext = _SETEXT.match(line)
        if atx:
            found.add(slugger.slug(heading_text(atx.group(2) or "")))
        elif (
            setext
            and previous
            and previous[0] == number - 1
            and previous[1].strip()
            and not _NOT_PARAGRAPH.match(previous[1])
            and not _SETEXT.match(previous[1])
        ):
            found.add(slugger.slug(heading_text(previous[1])))
        previous = (number, line)
    return frozenset(found)


@dataclass
class Link:
    line: int
    text: str  # as written, for the message
    target: str


def _destination(text: str, start: int) -> tuple[str, int] | None:
    """The destination of an inline link whose ``(`` is at ``start - 1``, and the index after its ``)``."""
    i = start
    while i < len(text) and text[i] in " \t\n":
        i += 1
    if text[i : i + 1] == "<":
        end = text.find(">", i)
        if end < 0:
            return None
        target, i = text[i + 1 : end], end + 1
    else:
        depth, j = 0, i
        while j < len(text) and not text[j].isspace():
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == "(":
                depth += 1
            elif text[j] == ")":
                if depth == 0:
                    break
                depth -= 1
            j += 1
        target, i = text[i:j], j
    close = text.find(")", i)  # past an optional title
    return (target, close + 1) if close >= 0 else None


def links(path: Path) -> list[Link]:
    """Every link of a page outside code, with the line it starts on."""
    found: list[Link] = []
    paragraphs: list[list[tuple[int, str]]] = [[]]
    for number, line in prose_lines(path):
        reference = _REFERENCE.match(line)
        if reference:
            target = reference.group(2).strip("<>")
            found.append(Link(number, reference.group(0).strip(), target))
            continue
        if line.strip():
            paragraphs[-1].append((number, line))
        elif paragraphs[-1]:
            paragraphs.append([])
    for paragraph in paragraphs:
        if not paragraph:
            continue
        raw = "\n".join(line for _, line in paragraph)
        # Code spans become blanks of their own length: offsets still map to lines and to the text as written.
        text = strip_code(raw, lambda code, span: re.sub(r"[^\n]", " ", span))
        starts = list(accumulate((len(line) + 1 for _, line in paragraph[:-1]), initial=0))

        def line_of(offset: int) -> int:
            return paragraph[bisect_right(starts, offset) - 1][0]  # noqa: B023 - line_of() is called within this iteration

        for match in re.finditer(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(", text):
            parsed = _destination(text, match.end())
            if parsed is None:
                continue
            target, end = parsed
            written = " ".join(raw[match.start() - (text[match.start() - 1 : match.start()] == "!") : end].split())
            found.append(Link(line_of(match.start()), written, target))
        for match in _HTML_LINK.finditer(text):
            found.append(Link(line_of(match.start()), " ".join(match.group(0).split()), match.group(1)))
    return sorted(found, key=lambda link: link.line)


def problems(page: Path) -> list[str]:
    """One line per link of ``page`` that does not resolve: file, line, link and what is missing."""
    out = []
    name = page.relative_to(REPO)
    for link in links(page):
        target = link.target.strip()
        if not target or _SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part, anchor = unquote(path_part), unquote(anchor)
        if path_part:
            base = REPO if path_part.startswith("/") else page.parent
            resolved = (base / path_part.lstrip("/")).resolve()
        else:
            resolved = page
        where = f"{name}:{link.line}: {link.text}"
        if not resolved.is_relative_to(REPO):
            out.append(f"{where}: '{path_part}' points outside the repository")
            continue
        if not resolved.exists():
            out.append(f"{where}: no file or directory {resolved.relative_to(REPO)}")
            continue
        if anchor and resolved.is_file() and resolved.suffix.lower() in MARKDOWN and anchor not in anchors(resolved):
            out.append(f"{where}: no heading or anchor '#{anchor}' in {resolved.relative_to(REPO)}")
    return out


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = problems(page)
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("`--mode spd`: the SPD engine", "--mode-spd-the-spd-engine"),
        ("L'_acc (n = 8)", "l_acc-n--8"),
        (
            "Hybrid targets: linear-attention state and its rollback (`spd/target/linear_state.py`)",
            "hybrid-targets-linear-attention-state-and-its-rollback-spdtargetlinear_statepy",
        ),
        ("§1 Stages and hidden states", "1-stages-and-hidden-states"),
        (
            "§9 Many requests in one pipeline (dynamic batching, SpecPipe-DB): `spd/decoding/batch.py`",
            "9-many-requests-in-one-pipeline-dynamic-batching-specpipe-db-spddecodingbatchpy",
        ),
        ("**Bold**, *emphasis* and [a link](docs/x.md)", "bold-emphasis-and-a-link"),
        ("`__init__` and __init__", "__init__-and-init"),
        ("snake_case_name", "snake_case_name"),
        ("A &amp; B", "a--b"),
        ("Über Café 2", "über-café-2"),
        ("Done ✅", "done-"),
        ('<a id="x"></a>Install', "install"),
    ],
)
def test_slug_of_tricky_headings(heading, expected):
    assert Slugger().slug(heading_text(heading)) == expected


def test_repeated_headings_get_numbered_slugs():
    slugger = Slugger()
    assert [slugger.slug(t) for t in ["Usage", "Usage", "usage", "Usage-1", "Other"]] == [
        "usage",
        "usage-1",
        "usage-2",
        "usage-1-1",
        "other",
    ]


def test_the_check_finds_what_is_broken(tmp_path, monkeypatch):
    """Missing files and anchors are reported with file, line and link; code, external links, explicit anchors,
    setext headings and numbered duplicates are handled."""
    root = tmp_path.resolve()
    monkeypatch.setattr(sys.modules[__name__], "REPO", root)
    (root / "docs").mkdir()
    (root / "docs" / "other.md").write_text("# Other page\n\n## Usage\n\n## Usage\n\nSetext one\n---\n")
    (root / "code.py").write_text("")
    page = root / "README.md"
    page.write_text(
        "\n".join(
            [
                '# Title <a id="top"></a>',
                "See [other](docs/other.md#usage-1), [setext](docs/other.md#setext-one), [top](#top), [self](#title),",
                "[code](code.py#L3), [site](https://example.com/x#y), [mail](mailto:a@b.c), `[in code](missing.md)`.",
                "```",
                "[in a fence](missing.md)",
                "```",
                "Broken: [`gone`](docs/gone.md) and [no anchor](docs/other.md#usage-2)",
                "and a link whose text [wraps",
                'a line](#nowhere), ![an image](img.png), <a href="docs/nope.md">html</a>.',
                "",
                "[ref]: docs/missing-ref.md",
            ]
        )
        + "\n"
    )
    anchors.cache_clear()
    assert problems(page) == [
        "README.md:7: [`gone`](docs/gone.md): no file or directory docs/gone.md",
        "README.md:7: [no anchor](docs/other.md#usage-2): no heading or anchor '#usage-2' in docs/other.md",
        "README.md:8: [wraps a line](#nowhere): no heading or anchor '#nowhere' in README.md",
        "README.md:9: ![an image](img.png): no file or directory img.png",
        'README.md:9: <a href="docs/nope.md">: no file or directory docs/nope.md',
        "README.md:11: [ref]: docs/missing-ref.md: no file or directory docs/missing-ref.md",
    ]
    anchors.cache_clear()


# ------------------------------------------------------------------------------------ what the docs weigh

RESULTS = REPO / "docs" / "results"
RESULTS_LIMIT = 5_000_000  # bytes: every file under docs/results together, most of it the per-prompt records
PAGES_LIMIT = 200_000  # bytes: docs/*.md together
# A page cites a result as `results/<path>` (a link, inline code or a command's `--out docs/results/...`), a family of
# them with braces (`results/x_{0,8}_{1,2}.json`), or a whole folder (`results/batching/`).
_CITATION = re.compile(r"(?<![\w-])results/((?:[\w.*/-]|\{[\w.,-]*\})+)")


def citing_pages() -> list[Path]:
    """The pages that cite results: the README, docs/ (not the tables under docs/results) and the heads' model cards."""
    pages = {REPO / "README.md", *(REPO / "docs").rglob("*.md"), *REPO.glob("heads/*/README.md")}
    return sorted(page for page in pages if not page.is_relative_to(RESULTS))


def expand(pattern: str) -> list[str]:
    """A brace family as the shell expands it: ``a_{0,8}_{1,2}`` is ``a_0_1``, ``a_0_2``, ``a_8_1``, ``a_8_2``."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for choice in match.group(1).split(",") for name in expand(head + choice + tail)]


def citations() -> dict[str, set[str]]:
    """Every result path the pages cite (relative to docs/results; a folder cites what it holds) and the pages citing
    it."""
    found: dict[str, set[str]] = {}
    for page in citing_pages():
        for match in _CITATION.finditer(page.read_text(encoding="utf-8")):
            for path in expand(match.group(1).rstrip(".")):
                found.setdefault(path, set()).add(str(page.relative_to(REPO)))
    return found


def result_files() -> list[str]:
    """The files under docs/results, relative to it; a benchmark's ``*.progress.jsonl`` journal is transient."""
    files = (path for path in RESULTS.rglob("*") if path.is_file() and not path.name.endswith(".progress.jsonl"))
    return sorted(str(path.relative_to(RESULTS)) for path in files)


def test_results_and_pages_stay_light():
    results = sum((RESULTS / name).stat().st_size for name in result_files())
    pages = sum(page.stat().st_size for page in (REPO / "docs").glob("*.md"))
    assert results < RESULTS_LIMIT, f"docs/results holds {results / 1e6:.2f} MB, over {RESULTS_LIMIT / 1e6:.0f}"
    assert pages < PAGES_LIMIT, f"docs/*.md hold {pages / 1e3:.1f} kB, over {PAGES_LIMIT / 1e3:.0f}"


def test_every_result_is_cited_by_a_page():
    cited = citations()
    folders = [path.rstrip("/") + "/" for path in cited if (RESULTS / path).is_dir()]
    uncited = [
        name
        for name in result_files()
        if name not in cited
        and not any(name.startswith(folder) for folder in folders)
        and not any(fnmatch(name, pattern) for pattern in cited if "*" in pattern)
    ]
    assert not uncited, "files under docs/results that no page cites (cite them or remove them):\n" + "\n".join(uncited)


def test_every_cited_result_exists():
    missing = [
        f"{', '.join(sorted(pages))}: results/{path}"
        for path, pages in sorted(citations().items())
        if not (list(RESULTS.glob(path.rstrip("/"))) if "*" in path else (RESULTS / path).exists())
    ]
    assert not missing, "pages cite results that do not exist:\n" + "\n".join(missing)


def test_a_citation_names_every_member_of_its_family():
    assert expand("b_{0,8}_{1,2}.json") == ["b_0_1.json", "b_0_2.json", "b_8_1.json", "b_8_2.json"]
    text = "see `results/x/{a,b}.json`, [one](results/y.json). Then docs/results/z/ and gpu-results/w.json"
    assert [m.group(1) for m in _CITATION.finditer(text)] == ["x/{a,b}.json", "y.json", "z/"]
