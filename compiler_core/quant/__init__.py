"""Post-training quantization: calibration inputs, profiles, range choice, accuracy report.

The passes that rewrite the graph live in compiler_core/passes (quantize, fold-qdq); the int8
kernels in compiler_core/ops/int8.py. docs/quantization.md describes the flow and the profile
file.
"""
