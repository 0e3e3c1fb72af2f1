# The engine tests' fixtures: one tiny model per session, one work directory and pool daemon per module.
from tests.vllm.conftest import pool, tiny_model, workdir  # noqa: F401
