"""The Sparrow services: generator, trainer and controller processes (they use the core, never the reverse)."""
