"""merge/factors.py: the merge math every merge calls, against dense references."""

import pytest
import torch

from fcprag_plugin import MergeError
from fcprag_plugin.merge import factors


def _factors(n, ranks=None, batch=(), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ranks = ranks or [2] * n
    As = [torch.randn(*batch, r, 5, generator=g).to(dtype) for r in ranks]
    Bs = [torch.randn(*batch, 7, r, generator=g).to(dtype) for r in ranks]
    return As, Bs


@pytest.mark.parametrize("batch", [(), (2,), (1, 3)])
def test_cat_is_the_exact_weighted_sum_of_updates(batch):
    As, Bs = _factors(3, [2, 4, 1], batch)
    c = [0.5, -1.25, 2.0]
    A, B = factors.cat(As, Bs, c)
    assert A.shape == (*batch, 7, 5) and B.shape == (*batch, 7, 7)  # rank 2 + 4 + 1
    ref = sum(ci * (b.double() @ a.double()) for ci, a, b in zip(c, As, Bs))
    torch.testing.assert_close((B @ A).double(), ref, rtol=1e-5, atol=1e-5)


def test_cat_keeps_each_factors_dtype_unless_one_is_asked():
    As, _ = _factors(2)
    _, Bs = _factors(2, dtype=torch.bfloat16)
    A, B = factors.cat(As, Bs, [0.5, 2.0])
    assert A.dtype == torch.float32 and B.dtype == torch.bfloat16
    ref = sum(c * (b.double() @ a.double()) for c, a, b in zip([0.5, 2.0], As, Bs))
    torch.testing.assert_close((B.double() @ A.double()), ref, rtol=1e-9, atol=1e-9)  # bf16 B widens exactly
    A, B = factors.cat(As, Bs, [0.5, 2.0], dtype=torch.float64)
    assert A.dtype == B.dtype == torch.float64
    torch.testing.assert_close(B @ A, ref, rtol=1e-12, atol=1e-12)


def test_separate_sums_each_factor_with_its_coefficients():
    As, Bs = _factors(3)
    a, b = [0.1, 0.2, 0.3], [1.0, -1.0, 0.5]
    A, B = factors.separate(As, Bs, a, b)
    torch.testing.assert_close(A.double(), sum(x * t.double() for x, t in zip(a, As)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(B.double(), sum(x * t.double() for x, t in zip(b, Bs)), rtol=1e-6, atol=1e-6)


def test_bf16_is_rounded_once_from_float32():
    As, Bs = _factors(2, dtype=torch.bfloat16)
    A, _ = factors.separate(As, Bs, [0.3, 0.7], [1.0, 1.0])
    want = (0.3 * As[0].float() + 0.7 * As[1].float()).to(torch.bfloat16)
    assert A.dtype == torch.bfloat16 and torch.equal(A, want)
    A, _ = factors.cat(As, Bs, [0.3, 0.7])
    assert torch.equal(A[:2], (0.3 * As[0].float()).to(torch.bfloat16))


def test_svd_keeps_the_best_rank_k_and_reports_the_dropped_energy():
    As, Bs = _factors(3)
    A, B = factors.cat(As, Bs, [1.0, 1.0, 1.0])
    dense = (B.double() @ A.double())
    Ak, Bk, dropped, total = factors.svd(A, B, 6)  # full rank: exact
    torch.testing.assert_close(Bk @ Ak, dense, rtol=1e-9, atol=1e-9)
    assert dropped == pytest.approx(0.0, abs=1e-9)
    Ak, Bk, dropped, total = factors.svd(A, B, 2)
    S = torch.linalg.svdvals(dense)
    assert Ak.shape == (2, 5) and Bk.shape == (7, 2)
    assert total == pytest.approx(float((S ** 2).sum())) and dropped == pytest.approx(float((S[2:] ** 2).sum()))
    assert float(torch.linalg.matrix_norm(dense - Bk @ Ak) ** 2) == pytest.approx(dropped, rel=1e-6)


def test_equal_rank_check_names_module_and_adapters():
    factors.check_equal_ranks([2, 2], "m", ["a", "b"])
    with pytest.raises(MergeError, match=r"mode 'separate' needs equal ranks.*module 'm' has ranks \[2, 4\].*\['a', 'b'\]"):
        factors.check_equal_ranks([(2,), (4,)], "m", ["a", "b"], shown=[2, 4])
