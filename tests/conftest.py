import logging
import os

import pytest
import torch

# One thread, in process and in the processes tests start (OMP_NUM_THREADS is inherited): the tests' matrices are
# tiny, and spin-waiting OpenMP threads on a shared 2-core CPU make them many times slower (the demo's steps ~10x)
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("longrl").setLevel(logging.WARNING)
    yield
