"""The one exception type tfpar raises for bad input or an unsupported request."""
import dataclasses
from typing import Iterable


class TfparError(Exception):
    """A problem tfpar found in what it was given; the message names it and the fix."""


class NotYetSupportedError(TfparError):
    """A valid request for a feature tfpar does not implement yet (never a silent fallback)."""


@dataclasses.dataclass(frozen=True)
class Blocker:
    """One thing in a graph that tfpar cannot handle: what (a variable or op) and the fix."""

    subject: str
    message: str
    not_yet: bool = False  # a valid request tfpar does not implement yet


def raise_blockers(blockers: Iterable[Blocker]) -> None:
    """Raises one error naming every blocker (so a user fixes them all in one go)."""
    blockers = list(dict.fromkeys(blockers))
    if not blockers:
        return
    if len(blockers) == 1:
        message = blockers[0].message
    else:
        message = (f"tfpar cannot run this graph; {len(blockers)} problems:\n"
                   + "\n".join(f"  {i}. {b.message}" for i, b in enumerate(blockers, 1)))
    cls = NotYetSupportedError if all(b.not_yet for b in blockers) else TfparError
    raise cls(message)


def summary(e: BaseException, limit: int = 400) -> str:
    """One line naming an exception and what it says, for the messages that stop a job.

    TensorFlow's graph errors put the op's creation stack before the cause ("Detected at
    node ... defined at", then indented frames); the frames are dropped so the cause
    (e.g. an assertion's message with its values) shows.
    """
    text = getattr(e, "message", None) or str(e)
    kept = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln[:1].isspace() and not ln.startswith(
                ("Detected at node", "Original stack trace", "Detected unsupported", "Node:",
                 "From /job:"))]
    return f"{type(e).__name__}: {' '.join(kept[:3])[:limit]}"
