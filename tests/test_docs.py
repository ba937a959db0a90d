"""The README and docs/ stay true to the tree: every relative link resolves (file and
heading anchor), every Config field is documented in the usage guide, and the README stays
a short guide (details live in docs/guide and docs/design)."""
import dataclasses
import glob
import os
import re

import tfpar
from tests.support.launch import REPO

LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def documents():
    return [os.path.join(REPO, "README.md")] + sorted(
        glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


def anchors(path):
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                text = line.lstrip("#").strip().lower()
                out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_every_link_resolves():
    broken = []
    for doc in documents():
        with open(doc) as f:
            text = f.read()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(full):
                broken.append(f"{os.path.relpath(doc, REPO)}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                broken.append(f"{os.path.relpath(doc, REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_config_field_is_documented():
    with open(os.path.join(REPO, "docs", "guide", "usage.md")) as f:
        guide = f.read()
    missing = [f.name for f in dataclasses.fields(tfpar.Config) if f.name not in guide]
    assert not missing, f"Config fields not in docs/guide/usage.md: {missing}"


def test_the_readme_is_a_short_guide_with_its_two_commands():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/run_example.sh" in readme and "bash scripts/test.sh" in readme
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "scripts/test.sh" in f.read()  # CI runs the README's test command
