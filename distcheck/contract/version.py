"""distcheck's version: report.json's "version" and ``distcheck --version``; ``distcheck.__version__`` re-exports it.

It lives here, not in distcheck/__init__.py, because what writes the report (contract/) and what a rank records
(rank/checks/envinfo.py) need it, and distcheck/__init__.py, the public API, imports rank code: no package imports
the API back (tests/unit/test_layout.py's test_no_package_cycle). It imports nothing, so ``import distcheck`` stays
free.
"""
__version__ = "0.1.0"
