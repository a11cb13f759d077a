"""Fixtures shared by the API tests: the embedded model, loaded once per module, and the real
openai client against a real server on it (test_openai_api.py and test_mesh.py keep their own:
theirs differ)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from seamline.app import LocalModel
from seamline.runtime.backend import LocalBackend
from tests.support.api import NAME, client_for, serve


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel.load()


@pytest.fixture(scope="module")
def client(model: LocalModel) -> Iterator[openai.OpenAI]:
    with serve(LocalBackend(model.engine, model.codec, NAME)) as url:
        yield client_for(url)
