"""Authentication: API keys, Clerk session tokens, and the principal they yield."""
