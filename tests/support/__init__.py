"""Helpers shared by the unit and cluster tests (fixtures are registered in tests/conftest.py)."""
