"""The oracle tests' data and runs: tiny Fashion-MNIST folders (tests/methods/conftest.py's bands), runs opened
in-process on them with ``guidance.model: oracle``, and this process's oracles forgotten after each test."""
import pytest

from fedguide.fl.setup import open_run, prepare
from fedguide.guidance.oracle.loading import forget_oracles
from tests.methods.conftest import write_fmnist
from tests.tiny import tiny_config


@pytest.fixture(autouse=True)
def fresh_oracles():
    forget_oracles()
    yield
    forget_oracles()


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory):
    """120 training images, a vertical band per class: the embedded pretraining pool is 10 of them."""
    return write_fmnist(tmp_path_factory.mktemp("fmnist"), n_train=120, vertical=True)


def oracle_config(fmnist_root, cache, method="fedavg", data=None, model=None, **params):
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root), **(data or {})},
                        "model": model or {"name": "mlp"}, "guidance": {"model": "oracle", "feature_cache": str(cache)},
                        "train": {"rounds": 2}}, method={"name": method, **params})


def opened_run(cfg, run_dir):
    """The RunContext of ``cfg`` opened in ``run_dir`` (nothing trained)."""
    return open_run(prepare(cfg), run_dir)[0]
