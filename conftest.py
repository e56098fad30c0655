"""Gives test_smoke.py, up here, and the study's tests in study/tests/ the fixtures of
tests/conftest.py (`prepared`, the tiny data): pytest applies a conftest.py only to its own folder
and below. Registered as a plugin, tests/conftest.py serves them all; the tests in tests/ see it as
their own conftest, as before."""
pytest_plugins = ['tests.conftest']
