"""Agents written against OpenAI's API (env=openai_agent)."""
