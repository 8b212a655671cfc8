"""`env=openai_agent`: an OpenAI-compatible endpoint inside the run, so agents written against OpenAI's API train unchanged."""
