"""Checks that need a CUDA device: `make test-gpu` on a GPU host (not collected by `make test`,
which must run without skips on CPU-only CI). Without CUDA they fail, saying so."""
from __future__ import annotations

import pytest
import torch

from peerd.train.tasks import get_task
from tests.test_train_lm import _train_pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    assert torch.cuda.is_available(), "make test-gpu needs a CUDA device (torch.cuda.is_available() is False)"
    return get_task("gpt", model_size="tiny", cache_dir=tmp_path_factory.mktemp("corpus-cache"))


def test_staged_exchange_on_cuda_trains_exactly_as_the_plain_one(tiny):
    """On a GPU: the CUDA engine (copy stream, events, pinned host buffers) gives the parameters
    the plain path gives with the same device kernels, and measures its copies."""
    plain, _ = _train_pair(tiny, False, 5, 4096, "adamw", "cuda")
    staged, times = _train_pair(tiny, True, 5, 4096, "adamw", "cuda")
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))
    for ts in times:
        assert [t.iteration for t in ts] == [0, 1, 2, 3]
        assert all(t.d2h_s > 0 and t.h2d_s > 0 and 0 <= t.overlap_s <= t.copy_s + 1e-9 for t in ts)
