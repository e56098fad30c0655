"""Gives test_smoke.py, up here, the fixtures of tests/conftest.py (`prepared`, the tiny data):
pytest applies a conftest.py only to its own folder and below. Registered as a plugin,
tests/conftest.py serves both; the tests in tests/ see it as their own conftest, as before."""
pytest_plugins = ['tests.conftest']
