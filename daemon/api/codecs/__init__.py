"""Codecs: between protocol bodies and engine requests (recipe, chat templates, completions)."""
