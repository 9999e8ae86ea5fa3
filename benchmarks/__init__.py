"""Side-by-side speed measurements of the loss scalers (``make bench``).

One process measures, with the variants interleaved round by round:

1. the torch facade (``cstorch.amp.GradScaler``) against ``torch.amp.GradScaler("cpu")`` and a
   bare ``optimizer.step()``, for SGD(foreach) and AdamW(fused), without and with clipping
   (:mod:`benchmarks.torch_bench`);
2. a jitted optax AdamW step alone and loss-scaled through ``amp_core``
   (:mod:`benchmarks.jax_bench`);
3. the machine's streaming rate and what fraction of that floor each scaler reaches
   (:mod:`benchmarks.bandwidth`);
4. the compile time of the first step and the compilations after warm-up.

Gradients come from one real backward pass per size (:mod:`benchmarks.sizes`) and are copied
back into ``.grad`` outside the timed region before every step. Results: a markdown report on the
terminal and in ``bench_output/bench.md``, every raw number in ``bench_output/bench.json``.
"""

from benchmarks.cli import main
from benchmarks.runner import BenchOptions, run

__all__ = ["BenchOptions", "main", "run"]
