"""Retrieval post-processing (whitening, DBA, alpha-QE, k-reciprocal re-ranking) for search.

The math lives in :mod:`deepmetric.evaluate.postprocess` and :mod:`deepmetric.evaluate.kreciprocal`
(the lowest layer, so that the in-training evaluation in ``train`` can use it too); this module is
its public name for search users. See docs/search.md, "Post-processing".
"""
from deepmetric.evaluate.kreciprocal import KReciprocalGraph, rerank
from deepmetric.evaluate.postprocess import (STEPS, Postprocessor, apply_whitening, aqe, check_steps, dba,
                                             fit_whitening, format_steps, parse_step, parse_steps)

__all__ = ["STEPS", "Postprocessor", "KReciprocalGraph", "apply_whitening", "aqe", "check_steps", "dba",
           "fit_whitening", "format_steps", "parse_step", "parse_steps", "rerank"]
