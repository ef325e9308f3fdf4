"""The Optuna study: search spaces, the ask-and-tell loop, outputs."""
