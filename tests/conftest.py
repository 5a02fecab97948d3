import logging

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("longrl").setLevel(logging.WARNING)
    yield
