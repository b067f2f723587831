"""Flat vectors in a real inner-product index (faiss, the `index` extra): its top-k is the model's."""
import math

import pytest
import torch

faiss = pytest.importorskip("faiss")

from topoclip.config import load_config  # noqa: E402
from topoclip.core.geometry import to_space  # noqa: E402
from topoclip.model.clip import CLIP  # noqa: E402

K = 10


@pytest.mark.parametrize("topology", ["sphere", "ps-inner"])  # the topologies whose similarity is an inner product
def test_an_inner_product_index_of_flat_vectors_returns_the_model_s_top_k(topology):
    model = CLIP(load_config("tiny", [f"model.topology={topology}"]).model)
    generator = torch.Generator().manual_seed(0)
    shape = model.embedding_shape
    gallery = to_space(topology, torch.randn(10_000, *shape, generator=generator))  # as encode_image gives them
    queries = to_space(topology, torch.randn(50, *shape, generator=generator))
    index = faiss.IndexFlatIP(shape[0] * shape[1])
    index.add(model.flatten(gallery).numpy())
    scores, found = index.search(model.flatten(queries).numpy(), K)
    expected = model.similarity(queries, gallery).topk(K + 1, dim=1)
    # Both are fp32 sums of m·n products of numbers with Σ|u_i v_i| ≤ m, in another order: they agree within
    # 2·γ(m·n)·m. Where two neighbours in the top k + 1 lie closer than that, either order is right; elsewhere
    # the rankings must be identical.
    bound = 2 * (shape[0] * shape[1] * 2.0**-24) / (1 - shape[0] * shape[1] * 2.0**-24) * shape[0]
    torch.testing.assert_close(torch.from_numpy(scores), expected.values[:, :K], atol=bound, rtol=0)
    separated = (expected.values[:, :-1] - expected.values[:, 1:]).min(dim=1).values > bound
    assert separated.float().mean() > 0.9  # random vectors: near-ties are rare
    assert torch.equal(torch.from_numpy(found)[separated], expected.indices[separated, :K])


def test_a_lorentz_model_s_index_vectors_give_its_nearest_neighbours():
    """A hyperbolic model has no flat form (its similarity is no inner product), but one hyperboloid ranks by the
    Lorentzian product: items [x, t], queries [x, −t] in an inner-product index find the nearest points."""
    from topoclip.core.geometry import lorentz_index_vectors

    model = CLIP(load_config("tiny", ["model.topology=lorentz", "model.curvature.init=0.6"]).model)
    generator = torch.Generator().manual_seed(1)
    shape, c = model.embedding_shape, model.curvature_value.detach()
    gallery = to_space("lorentz", 0.3 * torch.randn(10_000, *shape, generator=generator), curvature=c)
    queries = to_space("lorentz", 0.3 * torch.randn(50, *shape, generator=generator), curvature=c)
    index = faiss.IndexFlatIP(shape[0] * shape[1] + 1)
    index.add(lorentz_index_vectors(gallery, c, query=False).numpy())
    _, found = index.search(lorentz_index_vectors(queries, c, query=True).numpy(), K)
    expected = model.similarity(queries, gallery).topk(K + 1, dim=1)
    # The index's scores ⟨q, x⟩_L and the similarity −arcosh(−c⟨q, x⟩_L)/√c are computed in fp32 by different sums;
    # where two neighbours' distances lie within 1e-4 of each other (far above either's rounding: products of
    # coordinates ≲ 2, 65 terms, γ_65·(t_q t_x + |qᵀx|) ≈ 2e-5 on ⟨q, x⟩_L, whose distance's slope is ≤ 1/sqrt(2δ)
    # ≤ 3 at these δ > 0.05), either order is right; elsewhere the rankings must be identical.
    assert (-expected.values).min() > math.acosh(1.05) / float(c) ** 0.5  # δ = cosh(√c·d) − 1 > 0.05
    separated = (expected.values[:, :-1] - expected.values[:, 1:]).min(dim=1).values > 1e-4
    assert separated.float().mean() > 0.9
    assert torch.equal(torch.from_numpy(found)[separated], expected.indices[separated, :K])
