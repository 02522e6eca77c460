"""A tiny shop whose pages demonstrate distlocks."""
