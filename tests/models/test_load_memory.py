"""A load holds what the model keeps plus the f32 tensors of one projection at a time, and hands the freed
heap back once they are gone: checked on our code (which tensors are alive when), not on the machine's
resident memory (bench/load_memory.py measures that)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import pytest

from kvserve.models import gguf_file, loader


@dataclass
class Taken:
    ref: weakref.ref
    name: str
    dims: int
    nbytes: int

    @property
    def alive(self) -> bool:
        return self.ref() is not None


@pytest.fixture(scope="module")
def load_trace():
    """Loads SmolLM2 with q4 weights, noting at each tensor the model takes which taken f32 tensors are
    still alive, and the same when the loader releases the freed heap."""
    taken: list[Taken] = []
    alive_at_take: list[list[Taken]] = []
    alive_at_release: list[list[Taken]] = []
    load, release = gguf_file.GGUFWeights._load_array, loader.release_freed_memory

    def traced_load(self, name):
        alive_at_take.append([t for t in taken if t.alive])
        w = load(self, name)
        taken.append(Taken(weakref.ref(w), name, w.ndim, w.nbytes))
        return w

    def traced_release():
        alive_at_release.append([t for t in taken if t.alive])
        release()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_file.GGUFWeights, "_load_array", traced_load)
        mp.setattr(loader, "release_freed_memory", traced_release)
        model = loader.load_model("smollm2", weight_format="q4")
    assert model.config.num_layers == 30
    return model, taken, alive_at_take, alive_at_release


def test_no_matrix_is_dequantized(load_trace):
    """Every matrix of the file goes from its blocks to the kernels' layouts (models/file_linears.py): the
    tensors taken as f32 are the norms alone (1-D, 140 KB in all; the 211 matrices at f32 would be 538 MB)."""
    _, taken, alive_at_take, _ = load_trace
    assert len(taken) == len(alive_at_take) == 61  # 2 norms a layer and the final one
    assert all(t.dims == 1 for t in taken), [t.name for t in taken if t.dims > 1]
    assert sum(t.nbytes for t in taken) < 1 << 20


def test_the_freed_heap_is_released_once_only_the_kept_f32_tensors_live(load_trace):
    """When the loader hands the freed heap back, every matrix's f32 copy is gone (the tied embedding's
    table too: the int8 head holds it exactly); what lives is the norms (1-D, 140 KB)."""
    _, _, _, alive_at_release = load_trace
    assert len(alive_at_release) == 2  # after the tokenizer's build, before any weight; after the weights
    assert alive_at_release[0] == []
    alive = alive_at_release[1]
    assert all(t.dims == 1 for t in alive), [t.name for t in alive if t.dims > 1]
    assert sum(t.nbytes for t in alive) < 1 << 20
