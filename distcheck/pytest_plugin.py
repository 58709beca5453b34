"""pytest plugin (registered through the ``pytest11`` entry point): the ``distributed`` marker.

    @pytest.mark.distributed(nprocs=2, timeout=60)
    def test_allreduce(dist_ctx): ...
"""
from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(nprocs=2, timeout=60): run the test body on every rank with an initialized process group",
    )
