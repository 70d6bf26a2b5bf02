"""Fixtures every test file may use: a real redis-server for the run, a small tokenizer, the real model."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests' own helper modules

from devstack.redis_server import LocalRedis
from shared.config import BASE_MODEL_DIR
from tokenizer_fixtures import make_tokenizer_dir


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis: REDIS_URL where set, otherwise a redis-server this test run starts and stops."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with LocalRedis(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server.url


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The base checkpoint as converted (the tuned default answers tool names, not chat)."""
    if not (BASE_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the default model is not converted: run `make model`")
    return BASE_MODEL_DIR
