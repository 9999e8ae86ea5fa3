"""The device check: is the facade right and fast on this device? (It is not a benchmark.)

``python -m device_check --device cuda|cpu --out DIR [--quick] [--sections ...]`` or
``make device-check``; :mod:`device_check.check` describes the sections and the report. It
borrows the model sizes and timing helpers of :mod:`benchmarks`.
"""
