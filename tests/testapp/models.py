"""Models used by the test suite only."""
