"""`rayfactory serve` (alias `api`): an OpenAI-compatible Ray Serve application over ChatModel."""
