"""Sandbox backends, each one module implementing ``backends.base.SandboxBackend``."""
