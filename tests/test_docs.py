"""The README and the pages in `docs/` hold together: every relative link points to a file that exists and every
`#anchor` to a heading of that file (GitHub's slugs), every page is in the index, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^\s)>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"<[^>]+>", "", text)  # as do HTML tags' contents
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file's headings give, with GitHub's -1, -2 ... for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_the_slugs_are_githubs() -> None:
    assert slug("Worked example: Llama 3.2 1B on 2 nodes × 8 GPUs") == "worked-example-llama-32-1b-on-2-nodes--8-gpus"
    assert slug("RL on the demo: what has room, and what was measured") == (
        "rl-on-the-demo-what-has-room-and-what-was-measured"
    )
    assert slug("Alignment stages: SFT, reward model, PPO, GRPO / RLOO, DPO") == (
        "alignment-stages-sft-reward-model-ppo-grpo--rloo-dpo"
    )
    assert slug("The `tiny_model` preset") == "the-tiny_model-preset"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    links = relative_links(page)
    for target in links:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link {target!r} points to no file"
        if anchor:
            assert file.suffix == ".md", f"{page.relative_to(ROOT)}: link {target!r} has an anchor into a non-page"
            assert anchor in anchors(file), (
                f"{page.relative_to(ROOT)}: link {target!r}: {file.relative_to(ROOT)} has no heading {anchor!r}"
            )


def test_every_docs_page_is_in_the_index_and_the_index_is_linked_from_the_readme() -> None:
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / link.partition("#")[0]).resolve() for link in relative_links(index)}
    pages = set((ROOT / "docs").glob("*.md")) - {index}
    assert pages, "docs/ has no pages"
    assert not pages - listed, f"docs/README.md does not list {sorted(p.name for p in pages - listed)}"
    readme = {(ROOT / link.partition("#")[0]).resolve() for link in relative_links(ROOT / "README.md")}
    assert not pages - readme, f"README.md does not link {sorted(p.name for p in pages - readme)}"


def test_the_readme_reads_in_five_minutes() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move depth into docs/ (250 at most)"
