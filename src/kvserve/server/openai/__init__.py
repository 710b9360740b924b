"""OpenAI's APIs: chat and legacy completions, models, the Responses API."""
