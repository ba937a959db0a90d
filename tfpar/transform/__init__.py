"""Graph rewrites: each consumes a Plan and changes a copy of the user's graph."""
