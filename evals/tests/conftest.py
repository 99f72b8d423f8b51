from __future__ import annotations

import os

import pytest

from dpep_parity.evals.data import default_data_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def data_dir():
    d = default_data_dir()
    if not (d / "mmlu" / "test.jsonl").is_file():
        pytest.fail(f"offline eval data not found at {d}; set DPEP_DATA_DIR")
    return d


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache(tmp_path_factory):
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets-cache"))


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and avoids OpenMP spinning on a busy 2-core box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def eval_data(data_dir):
    from dpep_parity.evals.data import load_local

    return load_local(data_dir)


@pytest.fixture(scope="session")
def taskset(eval_data):
    from dpep_parity.evals.tasks import TaskSet

    return TaskSet(eval_data, max_gen_toks=8)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, data_dir):
    from dpep_parity.evals.tests.tiny_model import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"), data_dir)
