"""Use cases: plain async functions (and small classes) that take their collaborators."""
