"""End-to-end tests: a command in its own process: the gradsync CLI, an example, torchrun."""
