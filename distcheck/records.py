"""``distcheck.records``: the documented home of ``record`` and ``tolerance`` (re-exported from distcheck.rank.records).

    import distcheck.records
    distcheck.records.tolerance("loss", rtol=1e-3)

The implementation runs inside a rank and lives in :mod:`distcheck.rank.records`.
"""
from distcheck.rank.records import record, tolerance

__all__ = ["record", "tolerance"]
