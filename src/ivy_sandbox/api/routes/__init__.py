"""Routers. Each route: parse → one service call → shape the response."""
