"""pytest fixtures for projects that use distlocks (work in progress; see docs/testing.md)."""
