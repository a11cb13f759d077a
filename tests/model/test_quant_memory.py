"""A node holding a Q4 range keeps it at about its GGUF size.

Measured in fresh processes (``seamline_bench.resident``): RSS growth after loading a range
and running one token, less its KV cache, less at most 64 MB of fixed overhead, is within
1.25x of the bytes the range's tensors take in the GGUF file, embedding and head included.
Float32 storage of the same range would be about 6x.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline.app import default_model_path
from seamline.weights.packaging import package
from seamline_bench.resident import measure_in_subprocess

OVERHEAD = 64 << 20
RATIO = 1.25


@pytest.fixture(scope="module")
def embedded_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q4_package")
    package(default_model_path(), out, progress=False)
    return out


def _check(result: dict[str, int]) -> None:
    print(result)
    assert result["gguf_tensor_bytes"] > 20 << 20  # a real share of the model
    assert result["resident_weight_bytes"] - OVERHEAD <= RATIO * result["gguf_tensor_bytes"]


@pytest.mark.parametrize(
    "layers", [(0, 15), (15, 30)], ids=["first-half+embedding", "second-half+head"]
)
def test_a_node_range_from_fragments_stays_quantized(
    embedded_package: Path, layers: tuple[int, int]
) -> None:
    _check(measure_in_subprocess(embedded_package, *layers))


def test_the_whole_gguf_file_stays_quantized() -> None:
    _check(measure_in_subprocess(default_model_path(), 0, 30))
