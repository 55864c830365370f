"""Pure domain logic: sandbox states, the status body, identifiers. No I/O here."""
