"""Names tfpar gives the ops and shared state it adds, made from the user's variable names."""
import re


def safe_name(name: str) -> str:
    """`name` as one piece of an op or shared name: what TensorFlow refuses, `/` included,
    replaced by `_`."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


def scope_name(name: str) -> str:
    """`name` as a name-scope path: like `safe_name`, but `/` stays."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)
