"""OpenAI-compatible HTTP server (a later issue)."""
