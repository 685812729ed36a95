"""The attention backends' registry: `auto` takes the first backend whose capabilities run the model on the
device, a backend asked by name that cannot is a bad job naming `engine.attention` and why, and one that cannot
be built on this machine gives way to the next. No model runs: the layers are given as the load probe freezes
them."""

from __future__ import annotations

import pytest
import torch

from batchrun.engine.attention import FULL, LayerCall, LayerSpec, MaskKind, make_backend
from batchrun.engine.attention import backends as registry
from batchrun.engine.attention.backends import AttentionBackend, AttentionLayers, Capabilities
from batchrun.engine.attention.backends.cpu_paged import TorchAttention
from batchrun.engine.core.cache_spec import KVCacheSpec, KVGroups, KVShape
from batchrun.errors import BadInput

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # no tensor is made: no GPU needed


def model(*calls: LayerCall, v_head_dim: int = 32, dtype: torch.dtype = torch.float32) -> AttentionLayers:
    """Layers of these calls, 2 query heads on 1 KV head of dim 32 (values of `v_head_dim`), pages of 16."""
    groups = KVGroups.of_layers([(c.kind, KVShape(1, 32, v_head_dim)) for c in calls])
    specs = tuple(LayerSpec(i, groups.layer_group[i], True, c) for i, c in enumerate(calls))
    return AttentionLayers(2, KVCacheSpec(groups, 16, dtype), specs)


class NoSoftcap(AttentionBackend):
    """A CPU backend without soft-capping, tried first."""

    name = "nosoftcap"
    capabilities = Capabilities(devices=("cpu",), image_blocks=False, softcap=False)

    @classmethod
    def create(cls, layers, device):
        return cls()


def test_auto_takes_the_first_backend_that_supports_the_model(monkeypatch):
    monkeypatch.setattr(registry, "BACKENDS", (NoSoftcap, *registry.BACKENDS))
    plain, capped = model(LayerCall(FULL)), model(LayerCall(FULL), LayerCall(FULL, softcap=30.0))
    assert make_backend("auto", plain, CPU).name == "nosoftcap"
    assert NoSoftcap.supports(capped, CPU) == "layer 1 asks for logit soft-capping"
    assert make_backend("auto", capped, CPU).name in ("torch", "gather")  # gather: no compiler here
    with pytest.raises(BadInput, match=r"key `engine.attention`: nosoftcap .*soft-capping; use attention: "):
        make_backend("nosoftcap", capped, CPU)


def test_auto_on_cuda_is_triton_unless_the_kernels_do_not_take_the_model():
    window = LayerCall(MaskKind(window=8), sinks=torch.zeros(2))
    assert make_backend("auto", model(LayerCall(FULL), window), CUDA).name == "triton"
    # keys wider than values (MLA): not Triton's; torch runs on the CPU alone
    assert make_backend("auto", model(LayerCall(FULL), v_head_dim=16), CUDA).name == "gather"


def test_a_backend_asked_for_what_it_lacks_is_a_bad_job_naming_the_key_and_why():
    mla = model(LayerCall(FULL), v_head_dim=16)
    with pytest.raises(
        BadInput, match=r"key `engine.attention`: triton .*values of 16 \(MLA\); use attention"
    ):
        make_backend("triton", mla, CPU)  # on the CPU here through Triton's interpreter (conftest)
    with pytest.raises(
        BadInput, match=r"key `engine.attention`: torch .*runs on cpu, not cuda; use attention"
    ):
        make_backend("torch", model(LayerCall(FULL)), CUDA)
    with pytest.raises(BadInput, match=r"key `engine.attention`: torch .*pages of torch.float64"):
        make_backend("torch", model(LayerCall(FULL), dtype=torch.float64), CPU)
    assert make_backend("gather", mla, CUDA).name == "gather"


def test_a_backend_not_built_here_gives_way_to_the_next(monkeypatch):
    monkeypatch.setattr(TorchAttention, "create", classmethod(lambda cls, layers, device: None))
    assert make_backend("torch", model(LayerCall(FULL)), CPU).name == "gather"
    assert make_backend("auto", model(LayerCall(FULL)), CPU).name == "gather"
