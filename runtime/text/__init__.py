"""Chat templates: assistant-only loss masks, the end-of-turn token, the stop ids `target` records."""
