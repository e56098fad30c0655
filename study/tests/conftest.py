"""The study's tests: the tiny data of tests/conftest.py, prepared once per module."""
import pytest

from tests.conftest import prepare_tiny_data


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    return prepare_tiny_data(tmp_path_factory.mktemp('e2e'))
