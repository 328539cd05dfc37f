"""The device the gpu-marked tests run on: `--accel-device` (cuda by default; `cpu` checks the
tests themselves), skipped where it names CUDA and there is none."""

import pytest
import torch


@pytest.fixture(scope="module")
def device(pytestconfig) -> str:
    dev = pytestconfig.getoption("--accel-device")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device (run `pytest -m gpu` on a GPU machine)")
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 products
        torch.backends.cudnn.allow_tf32 = False
    return dev
