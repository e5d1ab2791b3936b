"""PowerSGD: bytes shrink by the factor its rank implies; warm start; small tensors go plain."""

from __future__ import annotations

import pytest
import torch

from training.compression import make_compressor, packet_to_bytes
from training.compression.powersgd import compresses

HEADER_ALLOWANCE = 64  # bytes: format byte, shape meta, two tensor headers


@pytest.mark.parametrize("rank", [1, 4, 8])
@pytest.mark.parametrize("shape", [(512, 256), (256, 128, 3, 3), (1000, 784), (64, 3, 7, 7)])
def test_bytes_shrink_by_the_rank_factor(rank: int, shape: tuple[int, ...]) -> None:
    gradient = torch.randn(shape)
    rows, cols = shape[0], gradient[0].numel()
    dense = len(packet_to_bytes(make_compressor("none").compress("w", gradient)))
    sent = len(packet_to_bytes(make_compressor(f"powersgd:{rank}").compress("w", gradient)))
    factor = rank * (rows + cols) / (rows * cols)
    assert sent <= factor * dense + HEADER_ALLOWANCE
    assert sent >= factor * dense  # P and Q really are on the wire
    assert sent < dense / 2


@pytest.mark.parametrize("shape", [(300,), (), (4, 4), (8, 2, 2), (3, 1000)])
def test_vectors_and_small_matrices_go_plain_float32(shape: tuple[int, ...]) -> None:
    compressor = make_compressor("powersgd:2")
    gradient = torch.randn(shape)
    packet = compressor.compress("b", gradient)
    assert list(packet.tensors) == ["x"]
    assert torch.equal(compressor.decompress(packet), gradient)
    assert torch.equal(compressor.state_dict()["residuals"]["b"], torch.zeros(shape))


def test_min_compression_rate_boundary() -> None:
    assert compresses([16, 16], 4)  # 4*32*2 = 256 <= 256
    assert not compresses([15, 16], 4)
    assert not compresses([3, 1000], 2)  # rank is capped at 3 rows, 3*1003*2 > 3000


def test_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    """On a fixed matrix, repeated rounds (warm-started Q, error feedback off) are power
    iteration: the error reaches the optimal rank-r error given by the SVD."""
    from training.compression.powersgd import PowerSGDCompressor

    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(60, 5, generator=generator), torch.randn(5, 80, generator=generator)
    matrix = left @ torch.diag(torch.tensor([10.0, 6.0, 3.0, 1.0, 0.5])) @ right
    rank = 2
    singular = torch.linalg.svdvals(matrix)
    best = float(singular[rank:].square().sum().sqrt())
    compressor = PowerSGDCompressor(rank, error_feedback=False)
    errors = []
    for _ in range(30):
        approx = compressor.decompress(compressor.compress("w", matrix))
        errors.append(float((matrix - approx).norm()))
    assert errors[-1] <= best * 1.001
    assert errors[0] > errors[-1]  # the warm start is what improves it
    cold = [PowerSGDCompressor(rank, seed=s, error_feedback=False) for s in range(3)]
    cold_errors = [float((matrix - c.decompress(c.compress("w", matrix))).norm()) for c in cold]
    assert min(cold_errors) > errors[-1]


def test_low_rank_matrix_is_sent_exactly() -> None:
    generator = torch.Generator().manual_seed(4)
    matrix = torch.randn(40, 2, generator=generator) @ torch.randn(2, 50, generator=generator)
    compressor = make_compressor("powersgd:2")
    approx = compressor.decompress(compressor.compress("w", matrix))
    torch.testing.assert_close(approx, matrix, atol=1e-4, rtol=1e-4)
