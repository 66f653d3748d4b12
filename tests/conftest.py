import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: OpenMP threads only add synchronization (and spin-waiting on a busy 2-core box).
    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
