"""The launcher (``python scripts/train.py``) and its tools, a package of the repository.

Its modules import each other as ``scripts.x``, as tests and benchmarks import them, from the
repository root: run as a file, an entry script puts the root on ``sys.path`` in place of
``scripts/`` itself, so no file here (``config``, ``arguments``, ...) shadows a library's module of
the same name. Not installed with the packages (``pyproject.toml`` lists those): it is the
repository's own entry point, not a library.
"""
