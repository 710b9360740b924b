"""Ollama's API: generate, chat, tags, ps, show, version."""
