"""The README's example script trains a user's own model over 4 threads on a LocalGroup ring."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def test_example_trains_own_model():
    path = Path(__file__).resolve().parents[1] / "examples" / "train_own_model.py"
    spec = importlib.util.spec_from_file_location("train_own_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        acc = mod.main(world=4, steps=150)
    finally:
        torch.set_num_threads(threads)
    assert acc > 0.9
