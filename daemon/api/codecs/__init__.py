"""Codecs (base.py's Codec): protocol bodies -> engine requests, engine outputs -> protocol
answers (completions, dense chat templates, deepseek-recipe). Nothing here knows HTTP."""
