"""Every shell command the README and the guide show runs as written.

The commands are the lines of the ```bash blocks of README.md and docs/guide/*.md. Each
document's commands run in order, as written, from the repository's root (where the README
says to type them), with every /tmp/ path redirected into a fresh temporary folder. A
command fails the test when it exits non-zero or when its output lacks what its comment
says it prints (`# prints "..."`, where `...` inside the quotes matches anything).

A block the suite cannot run (several hosts, root, a GPU, a long benchmark, the suite
itself) carries a marker on the line before it:
    <!-- suite: skip (why) -->                 the whole block
    <!-- suite: skip "text" (why) -->          its lines that contain "text"
The test prints what it ran and what it skipped, with the marker's reason.
"""
import glob
import os
import re
import subprocess
import time

import pytest

from tests.support.launch import REPO

DOCUMENTS = ["README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "guide", "*.md")))
MARKER = re.compile(r'<!--\s*suite:\s*skip\s*(?:"([^"]+)")?\s*\(([^)]+)\)\s*-->')
PRINTS = re.compile(r'prints "([^"]+)"')
TIMEOUT = 420  # one command: the examples train for a few seconds on a loaded 2-core machine


def commands(document):
    """[(command, skip reason or None, [expected output])] of a document, in order."""
    with open(os.path.join(REPO, document)) as f:
        lines = f.read().splitlines()
    out, marker, block, shell = [], None, False, False
    for line in lines:
        fence = line.strip().startswith("```")
        if fence and not block:
            block, shell = True, line.strip()[3:].strip() in ("bash", "sh", "shell")
            continue
        if fence:
            block, marker = False, None
            continue
        if not block:
            found = MARKER.search(line)
            if found:
                marker = found.groups()
            elif line.strip():
                marker = None  # a marker applies to the block right after it
            continue
        if not shell or not line.strip() or line.lstrip().startswith("#"):
            continue
        if out and out[-1][0].endswith("\\"):  # a continued line
            prev = out.pop()
            line = prev[0][:-1] + " " + line.strip()
        command = re.sub(r"\s+#.*$", "", line.strip())  # the comment says what it prints
        skip = None
        if marker is not None and (marker[0] is None or marker[0] in command):
            skip = marker[1]
        out.append((command, skip, PRINTS.findall(line)))
    return out


def _redirect(text, tmp):
    return text.replace("/tmp/", str(tmp) + "/")


def _printed(expected, output):
    pattern = ".*?".join(re.escape(part) for part in expected.split("..."))
    return re.search(pattern, output) is not None


def test_every_document_has_commands_and_every_marker_a_reason():
    found = {d: commands(d) for d in DOCUMENTS}
    assert found["README.md"], "the README shows no command"
    listing = []
    for document, cmds in found.items():
        for command, skip, _ in cmds:
            if skip is None and command in _earlier(document):
                skip = "run for an earlier document"
            listing.append(f"{'skipped' if skip else 'runs   '} {document}: {command}"
                           + (f"   [{skip}]" if skip else ""))
    print("\n".join(listing))
    # The README's own two commands: the example runs here; the test command is the suite
    # itself, which CI runs.
    readme = {c: s for c, s, _ in found["README.md"]}
    assert readme["bash scripts/run_example.sh"] is None
    assert readme["bash scripts/test.sh"] is not None


def _earlier(document):
    """Commands an earlier document runs: the same line shown twice runs once."""
    return {c for d in DOCUMENTS[:DOCUMENTS.index(document)] for c, s, _ in commands(d)
            if s is None}


def _to_run(document):
    return [c for c, s, _ in commands(document) if s is None and c not in _earlier(document)]


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if _to_run(d)])
def test_commands_run_as_written(document, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    ran, skipped, earlier = [], [], _earlier(document)
    for command, skip, expected in commands(document):
        if skip:
            skipped.append(f"{command}   [{skip}]")
            continue
        if command in earlier:
            skipped.append(f"{command}   [run for an earlier document]")
            continue
        start = time.time()
        proc = subprocess.run(["bash", "-c", _redirect(command, tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TIMEOUT)
        assert proc.returncode == 0, \
            f"{document}: `{command}` exited with {proc.returncode}:\n{proc.stdout[-6000:]}"
        for text in expected:
            assert _printed(_redirect(text, tmp_path), proc.stdout), \
                f"{document}: `{command}` did not print {text!r}:\n{proc.stdout[-6000:]}"
        ran.append(f"{command}   ({time.time() - start:.0f} s)")
    print(f"{document}: ran {len(ran)}, skipped {len(skipped)}")
    print("\n".join(["ran:"] + ran + ["skipped:"] + skipped))
    assert ran
