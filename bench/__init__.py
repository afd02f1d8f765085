"""kvfill.bench: the main job (e2e.py), the benchmarks and the studies (the GPU run is kvfill.gpu).

Run them as scripts (``python bench/e2e.py``) or modules
(``python -m kvfill.bench.e2e``); they import each other as ``kvfill.bench.*``.
"""
