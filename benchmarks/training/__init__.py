"""Training evidence: ``python -m benchmarks.training`` (``__main__.py``) and its parts — the corpus (``data``),
the model and the induced key offset (``model``), the per-step instruments (``probe``) and the report
(``report``)."""
