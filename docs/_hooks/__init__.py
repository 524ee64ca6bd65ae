"""The parts of the docs site generated from the code, one module per job; docs/hooks.py (the
mkdocs entry point) hands a page's markers to them.

- ``base``: where the repository and its results are, the marker error, text helpers;
- ``page``: what happens to every page's own Markdown (the run command under the title, folded
  pitfalls, links to recipes and to the torch APIs);
- ``mermaid``: two-way arrows for collectives, and the vendored mermaid only on pages that draw;
- ``options``, ``results``, ``index``, ``api``, ``source``: one marker each (``source`` also links
  the tests a page names to their assertions);
- ``charts`` (from results/), ``diagrams`` (from the code's shapes and schedules) and ``svg``, the
  drawing helpers both use.

A package, not modules beside hooks.py: mkdocs loads hooks by file path, so hooks.py puts docs/ on
``sys.path`` and imports this package by name (the tests load hooks.py the same way).
"""
