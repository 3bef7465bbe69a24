"""Learning code: building the project's own tokenizer and models, evaluation (no services, no CLI)."""
